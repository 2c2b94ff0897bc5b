// `lorasync serve`: the inference server (http-api.md). SIGTERM/SIGINT stop it gracefully: no new
// connections, in-flight requests finish within --shutdown-grace, then exit 0.
#include <signal.h>

#include <cstdio>
#include <thread>

#include "commands.h"
#include "server/api_server.h"
#include "util/error.h"
#include "util/log.h"

namespace lorasync::cli {

namespace {

int run(server::ServeOptions o) {
  // Block the stop signals in every thread; this one waits for them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  server::ApiServer srv(o);
  srv.start();
  std::printf("{\"event\": \"listening\", \"port\": %u}\n", static_cast<unsigned>(srv.port()));
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  LS_LOG_INFO("server", "signal {}: stopping (grace {} s)", sig, o.shutdown_grace_s);
  // A second signal exits at once.
  std::thread([set]() mutable {
    int s2 = 0;
    sigwait(&set, &s2);
    std::_Exit(1);
  }).detach();
  srv.stop(o.shutdown_grace_s);
  return 0;
}

}  // namespace

void register_serve(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<server::ServeOptions>();
  auto* sub = root.add_subcommand("serve", "OpenAI-compatible inference server with run-time LoRA");
  sub->add_option("--model", o->model_dir, "model directory (config.json, safetensors, tokenizer)")->required();
  sub->add_option("--served-model-name", o->served_model_name, "base model name (default: directory name)");
  sub->add_option("--tokenizer", o->tokenizer, "tokenizer directory (default: the model directory)");
  sub->add_option("--host", o->host, "listen address")->capture_default_str();
  sub->add_option("--port", o->port, "listen port (0 = any free port)")->capture_default_str();
  sub->add_option("--api-key", o->api_key, "require Authorization: Bearer KEY (or LORASYNC_API_KEY)");
  sub->add_option("--dtype", o->dtype, "auto|float32|bfloat16|float16")->capture_default_str();
  sub->add_option("--device", o->device, "cpu|cuda[:N]")->capture_default_str();
  sub->add_option("--max-model-len", o->max_model_len, "context length (0 = the model's)")->capture_default_str();
  sub->add_option("--max-num-seqs", o->max_num_seqs, "sequences per batch")->capture_default_str();
  sub->add_option("--max-num-batched-tokens", o->max_num_batched_tokens, "tokens per forward (prefill chunk)")->capture_default_str();
  sub->add_option("--kv-cache-memory", o->kv_cache_memory, "KV pool size (e.g. 2GiB)")->capture_default_str();
  sub->add_option("--block-size", o->block_size, "tokens per KV block")->capture_default_str();
  auto no_prefix = std::make_shared<bool>(false);
  sub->add_flag("--no-enable-prefix-caching", *no_prefix, "disable the prefix cache");
  sub->add_option("--enable-prefix-caching", o->enable_prefix_caching, "true|false")->capture_default_str();
  sub->add_flag("--enforce-eager", o->enforce_eager,
                "run decode steps without CUDA graphs (they are captured per batch-size bucket on CUDA by default)");
  sub->add_option("--max-loras", o->max_loras, "adapter slots")->capture_default_str();
  sub->add_option("--max-lora-rank", o->max_lora_rank, "largest adapter rank")->capture_default_str();
  sub->add_option("--allowed-adapter-root", o->allowed_adapter_roots, "adapter paths must lie under one of these (repeatable)");
  sub->add_option("--threads", o->threads, "compute threads (0 = all cores)")->capture_default_str();
  sub->add_option("--http-threads", o->http_threads, "HTTP io threads")->capture_default_str();
  sub->add_option("--shutdown-grace", o->shutdown_grace_s, "seconds to finish in-flight requests on SIGTERM")->capture_default_str();
  sub->add_option("--max-body-bytes", o->max_body_bytes, "largest request body (larger: 413)")->capture_default_str();
  sub->add_option("--adapter-prepare-ttl", o->adapter_prepare_ttl_s,
                  "seconds a pushed adapter waits for its commit before its slot may be reused")->capture_default_str();
  sub->add_option("--max-connections", o->max_connections,
                  "open connections at most; more get 503 (0 = what the open-file limit allows)")->capture_default_str();
  sub->add_option("--max-queued-seqs", o->max_queued_seqs,
                  "sequences (prompts x n) queued or running at most; more answer 429 (0 = max(4096, 16 x --max-num-seqs))")
      ->capture_default_str();
  sub->add_option("--step-timeout", o->step_timeout_s, "seconds an engine step may run before /health answers 503")
      ->capture_default_str();
  auto seed = std::make_shared<std::uint64_t>(0);
  sub->add_option("--seed", *seed, "accepted for vLLM compatibility (requests carry their own seeds)");
  reg.add(sub, [o, no_prefix]() {
    if (*no_prefix) o->enable_prefix_caching = false;
    return run(*o);
  });
}

}  // namespace lorasync::cli
