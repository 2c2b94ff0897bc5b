// `lorasync bench proxy --stubs python`: the stub replicas (bench/proxy/py_stubs.py, both on one
// event loop) and the load client (bench/proxy/py_client.py) are Python processes on the same
// cores as the proxy, as an independent harness runs them: the machine is contended by Python
// work, and the client parses nothing the C++ client would not. The stubs answer as `lorasync
// serve` does (completion_body.h's table and shape); the trace is the C++ configuration's. Each
// round runs ours and the reference (with --reference), the order reversed every other round; the
// CPU per request of each proxy is its scheduler counters over the client's run, the same
// statistic on both sides (the median over rounds, per-round values in the config).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/proxy/completion_body.h"
#include "bench/proxy/grpo_trace.h"
#include "bench_proxy.h"
#include "proc_stats.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/strings.h"

namespace lorasync::cli::bench_proxy {

namespace {

struct PyStubs {
  pid_t pid = -1;
  std::vector<std::string> urls;
};

PyStubs spawn_py_stubs(const BenchProxyOptions& o, const std::string& table) {
  int fds[2];
  if (pipe(fds) != 0) throw_env("pipe failed");
  const std::string script = std::string(LORASYNC_SOURCE_DIR) + "/bench/proxy/py_stubs.py";
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    for (int fd = 3; fd < 65536; ++fd) close(fd);
    execlp(o.python.c_str(), o.python.c_str(), script.c_str(), "--table", table.c_str(), "--replicas", "2",
           static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  const std::string line = read_child_line(fds[0]);
  if (!line.starts_with("ports ")) throw_env("bench proxy: the Python stubs ({} {}) did not start: '{}'", o.python, script, line);
  PyStubs s;
  s.pid = pid;
  for (const auto& p : split(line.substr(6), ' '))
    if (!p.empty()) s.urls.push_back("http://127.0.0.1:" + std::string(p));
  return s;
}

struct PyRound {
  double cpu_ms = 0, req_per_s = 0, body_bytes = 0;
  std::size_t requests = 0, errors = 0;
};

// The Python client through `ch` over the whole trace; `ch` is stopped after.
PyRound measure(const BenchProxyOptions& o, const Child& ch, const std::string& trace_file, int conc) {
  const std::string cmd = sh_quote(o.python) + " " +
                          sh_quote(std::string(LORASYNC_SOURCE_DIR) + "/bench/proxy/py_client.py") + " --url " +
                          sh_quote("http://127.0.0.1:" + std::to_string(ch.port)) + " --trace " + sh_quote(trace_file) +
                          " --concurrency " + std::to_string(conc) + " 2>&1";
  const double cpu0 = proc_cpu_s(ch.pid);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw_env("bench proxy: cannot start {}", o.python);
  std::string text;
  char buf[4096];
  while (std::size_t k = std::fread(buf, 1, sizeof buf, p)) text.append(buf, k);
  const int rc = pclose(p);
  const double cpu1 = proc_cpu_s(ch.pid);
  stop_child(ch);
  const auto brace = text.rfind('{');
  const nlohmann::json j = rc == 0 && brace != std::string::npos ? nlohmann::json::parse(text.substr(brace), nullptr, false)
                                                                 : nlohmann::json();
  if (!j.is_object() || !j.contains("requests")) throw_env("bench proxy: the Python client failed: {}", trim(text));
  PyRound r;
  r.requests = j["requests"].get<std::size_t>();
  r.errors = j["errors"].get<std::size_t>();
  r.body_bytes = j["body_bytes"].get<double>();
  r.req_per_s = static_cast<double>(r.requests) / std::max(1e-9, j["seconds"].get<double>());
  r.cpu_ms = (cpu1 - cpu0) * 1000.0 / static_cast<double>(std::max<std::size_t>(1, r.requests));
  return r;
}

double median(std::vector<double> xs) {
  if (xs.empty()) return 0;
  std::sort(xs.begin(), xs.end());
  const std::size_t n = xs.size();
  return n % 2 ? xs[n / 2] : (xs[n / 2 - 1] + xs[n / 2]) / 2;
}

}  // namespace

int run_python_stubs(const BenchProxyOptions& o) {
  BenchReporter rep;
  char tmpl[] = "/tmp/lorasync-bench-proxy-py-XXXXXX";
  if (!mkdtemp(tmpl)) throw_env("bench proxy: mkdtemp failed");
  const std::string dir = tmpl;
  const std::string table = dir + "/table.json", trace_file = dir + "/trace.jsonl";
  std::ofstream(table) << bench::generation_table_json();
  bench::TraceOptions to;
  to.prompts = o.prompts;
  const auto trace = bench::make_grpo_trace(to);
  {
    std::ofstream out(trace_file);
    for (const auto& t : trace) out << t.body << '\n';
  }
  PyStubs stubs = spawn_py_stubs(o, table);
  struct Cleanup {
    PyStubs& s;
    std::string dir;
    ~Cleanup() {
      stop_child({s.pid, 0});
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{stubs, dir};
  for (const auto& cs : split(o.concurrency, ',')) {
    const int conc = std::stoi(std::string(trim(cs)));
    std::vector<PyRound> ours, refs;
    std::vector<std::string> first;
    for (int round = 0; round < std::max(1, o.rounds); ++round) {
      const bool forward = round % 2 == 0;
      if (forward || o.reference.empty()) {
        ours.push_back(measure(o, spawn_proxy(stubs.urls, o.proxy_threads), trace_file, conc));
        if (!o.reference.empty()) refs.push_back(measure(o, spawn_reference(o, stubs.urls), trace_file, conc));
      } else {
        refs.push_back(measure(o, spawn_reference(o, stubs.urls), trace_file, conc));
        ours.push_back(measure(o, spawn_proxy(stubs.urls, o.proxy_threads), trace_file, conc));
      }
      if (!o.reference.empty()) first.emplace_back(forward ? "ours" : "reference");
    }
    auto list = [](const std::vector<PyRound>& v, double PyRound::*f) {
      std::vector<double> xs;
      for (const auto& r : v) xs.push_back(r.*f);
      return xs;
    };
    std::size_t errors = 0, requests = 0;
    double bytes = 0;
    for (const auto& r : ours) errors += r.errors, requests += r.requests, bytes += r.body_bytes;
    const double per_choice = requests ? bytes / static_cast<double>(requests) : 0;  // n = 1 per request
    nlohmann::json cfg = {{"concurrency", conc}, {"requests", trace.size()}, {"stubs", "python"},
                          {"max_tokens", to.max_tokens}, {"body_bytes_per_choice", std::lround(per_choice)},
                          {"proxy_threads", o.proxy_threads}, {"errors", errors}, {"rounds", ours.size()},
                          {"client", "bench/proxy/py_client.py, one keep-alive connection per worker"}};
    const double cpu = median(list(ours, &PyRound::cpu_ms));
    if (!refs.empty()) {
      nlohmann::json c = cfg;
      c["baseline"] = "the reference proxy (Python), same run, same Python stubs and client";
      c["first_per_round"] = first;
      c["ours_per_round"] = list(ours, &PyRound::cpu_ms);
      c["reference_per_round"] = list(refs, &PyRound::cpu_ms);
      std::vector<double> ratios;
      for (std::size_t i = 0; i < ours.size() && i < refs.size(); ++i) ratios.push_back(ours[i].cpu_ms / refs[i].cpu_ms);
      c["round_ratios"] = ratios;
      std::size_t ref_errors = 0;
      for (const auto& r : refs) ref_errors += r.errors;
      c["reference_errors"] = ref_errors;
      rep.emit({"proxy", "cpu_ms_per_request_vs_reference", cpu, "ms", median(list(refs, &PyRound::cpu_ms)), c});
      nlohmann::json c2 = cfg;
      c2["ours_per_round"] = list(ours, &PyRound::req_per_s);
      c2["reference_per_round"] = list(refs, &PyRound::req_per_s);
      rep.emit({"proxy", "requests_per_s_vs_reference", median(list(ours, &PyRound::req_per_s)), "req/s",
                median(list(refs, &PyRound::req_per_s)), c2});
    }
    nlohmann::json c1 = cfg;
    c1["baseline"] = "none";
    c1["per_round"] = list(ours, &PyRound::cpu_ms);
    rep.emit({"proxy", "cpu_s_per_1k_requests", cpu, "s", std::nullopt, c1});
    c1.erase("per_round");
    rep.emit({"proxy", "stub_body_bytes_per_choice", per_choice, "B", std::nullopt, c1});
  }
  rep.print_table();
  return 0;
}

}  // namespace lorasync::cli::bench_proxy
