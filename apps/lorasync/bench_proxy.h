// apps/lorasync/bench_proxy.h: the pieces of `lorasync bench proxy` shared by its two
// configurations: in-process C++ stubs and client (bench_proxy.cpp) and Python stubs and client
// (bench_proxy_py.cpp). Children are started with fork/exec; the caller stops them (SIGTERM).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lorasync::cli::bench_proxy {

struct BenchProxyOptions {
  std::string concurrency = "32,128,384";
  int prompts = 1024;  // x G = 8: 8,192 requests per point
  double stub_latency = 0;   // zero-service-time stubs by default
  double stub_latency_spread = 0;  // each completion uniform in latency x [1 - s, 1 + s]
  int stub_nice = 0;               // the stubs' threads' nice value (0: unchanged)
  std::string stub_threads = "shared";  // shared: one thread serves both stubs; per-replica: one each
  int proxy_threads = 1;
  int client_threads = 1;
  // The HF Python proxy (lora_proxy.py of AmineDiro/hfjobs-lora-buckets), fetched by the user
  // into a temporary directory and run by `python` (it needs aiohttp: the .venv's has it): the
  // same load goes through it in the same run. Never committed here.
  std::string reference;
  std::string python = "python3";
  int rounds = 1;  // ours and the reference alternated this many times per concurrency
  std::int64_t tracked_blocks = 500000;  // entries of the bytes-per-tracked-block figure, both tables
  // cpp: the in-process C++ stubs and client (bench_proxy.cpp); python: stub replicas and a load
  // client as Python processes (bench/proxy/py_stubs.py, py_client.py) on the same cores, as an
  // independent harness runs them (bench_proxy_py.cpp).
  std::string stubs = "cpp";
};


struct Child {
  pid_t pid = -1;
  std::uint16_t port = 0;
};

std::string sh_quote(const std::string& s);
std::uint16_t free_port();
bool port_open(std::uint16_t port);
// Our proxy (`lorasync proxy`, `threads` I/O threads) in front of `upstreams`.
Child spawn_proxy(const std::vector<std::string>& upstreams, int threads);
// The reference proxy: `python FILE` with its environment (UPSTREAM_URLS, PROXY_PORT, HF_TOKEN).
Child spawn_reference(const BenchProxyOptions& o, const std::vector<std::string>& upstreams);
// The reference's table filled to `entries` blocks through its own router: its JSON summary, or
// {"error": ...}.
nlohmann::json reference_block_bytes(const BenchProxyOptions& o, std::int64_t entries);
// SIGTERM, then wait for it.
void stop_child(const Child& ch);
// The first line a child wrote to the pipe `fd` (read a byte at a time, so nothing after it is
// taken), without its newline; closes `fd`.
std::string read_child_line(int fd);

// --stubs python: the whole bench in that configuration (its rows into the report, printed).
int run_python_stubs(const BenchProxyOptions& o);

}  // namespace lorasync::cli::bench_proxy
