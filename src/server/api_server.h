// server/api_server.h: `lorasync serve`: the engine behind the HTTP API of http-api.md.
//
// Threads: the engine thread (engine.h); `http_threads` io threads running one coroutine per
// connection (src/http); one blocking-work thread for adapter file reads and waits on the engine,
// so no io thread ever blocks. Engine output reaches a request's coroutine through a channel: the
// engine thread appends and posts a wake-up to the connection's strand.
// Shutdown (SIGTERM): stop accepting, let in-flight requests finish for up to the grace period,
// then abort what is left (streams end without [DONE]) and exit.
// Thread-safety: start/stop/wait/port are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lorasync::server {

struct ServeOptions {
  std::string model_dir;                    // Hugging Face model directory
  std::string served_model_name;            // "" = the directory's name
  std::string tokenizer;                    // "" = the model directory
  std::string host = "127.0.0.1";
  std::uint16_t port = 8000;                // 0 = any free port (printed at start)
  std::string api_key;                      // "" = no auth (or LORASYNC_API_KEY)
  std::string dtype = "auto";               // auto|float32|bfloat16|float16
  std::string device = "cpu";
  std::int64_t max_model_len = 0;           // 0 = the model's max_position_embeddings
  std::int64_t max_num_seqs = 256;
  std::int64_t max_num_batched_tokens = 2048;
  std::string kv_cache_memory = "1GiB";
  std::int64_t block_size = 16;
  bool enable_prefix_caching = true;
  bool enforce_eager = false;               // no CUDA graphs for decode steps
  int max_loras = 4;
  std::int64_t max_lora_rank = 16;
  std::vector<std::string> allowed_adapter_roots;  // empty = any path
  int threads = 0;                          // compute threads, 0 = all cores
  int http_threads = 2;
  double shutdown_grace_s = 30;
  std::uint64_t max_body_bytes = 64ull << 20;  // the proxy's default too
  std::size_t max_connections = 0;          // 0: from the open-file limit; more: 503
  std::int64_t max_queued_seqs = 0;         // 0 = max(4096, 16 x max_num_seqs); more: 429
  double step_timeout_s = 120;              // /health answers 503 while a step runs longer
  double adapter_prepare_ttl_s = 120;       // a prepared (pushed, uncommitted) adapter's slot is reclaimable after
};


class ApiServer {
 public:
  explicit ApiServer(ServeOptions options);  // loads the model and the tokenizer, starts the engine
  ~ApiServer();
  void start();                 // binds and serves
  std::uint16_t port() const;
  void stop(double grace_s);    // graceful; idempotent
  void wait();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorasync::server
