// engine/engine.h: the inference engine: continuous batching over a paged KV cache with a prefix
// cache and several LoRA adapters per batch. No JSON, no sockets.
//
// Threads: one engine thread owns the scheduler, the KV blocks, the sequences and the adapter
// slots. Every public member function below is thread-safe: it either reads an immutable
// snapshot (adapters, stats) or posts a command to the engine thread. Output goes to each
// request's RequestSink on the engine thread.
//
// One engine step:
//   1. apply commands (new requests, aborts, adapter installs/unloads, pause/resume, cache reset);
//   2. schedule: running sequences first (decode = 1 token; unfinished prefill = a chunk), then
//      admit waiting ones (FIFO) while the token budget (max_num_batched_tokens), max_num_seqs and
//      free KV blocks allow; a sequence that cannot get a block preempts the newest running one
//      (its blocks are freed; it is recomputed later, prefix cache permitting);
//   3. one model forward over the flat batch (mixed prefill and decode, mixed adapters);
//   4. sample where a sequence reached its end of input; a request with n > 1 forks after its
//      prompt: the n sequences share the prompt's blocks (the partial last block is copied);
//   5. stop checks (EOS, stop ids, stop strings, max_tokens, context), deliver outputs, free.
//
// Adapter slots (max_loras): load = files are read and validated by the caller's thread
// (adapter_store.h), then the engine thread installs the weights into a free slot and publishes
// the name (a pointer swap between steps). Names are immutable: the same name with the same
// checksum is a no-op, with another checksum a Conflict. Unload hides the name at once and frees
// the slot when its last request ends. A full set of slots with requests in flight refuses a load
// (Unavailable); idle draining slots are reclaimed.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/adapter_store.h"
#include "engine/request.h"

namespace lorasync::model {
class DecoderModel;
}
namespace lorasync::tok {
class Tokenizer;
}

namespace lorasync::engine {

struct EngineOptions {
  std::string served_model_name = "model";  // the base model's name in requests
  std::int64_t max_model_len = 4096;         // prompt + completion tokens per sequence
  std::int64_t max_num_seqs = 256;           // sequences in the running batch
  std::int64_t max_num_batched_tokens = 2048;  // tokens per forward (prefill chunking)
  std::int64_t block_size = 16;              // tokens per KV block
  std::int64_t kv_cache_bytes = 1ll << 30;   // size of the KV pool
  bool enable_prefix_caching = true;
  // Decode steps replayed from CUDA graphs, one per batch-size bucket (core/model/decode_graphs.h):
  // kAuto where the model is on CUDA and the build has our kernels; kOff never (serve
  // --enforce-eager); kAlways also elsewhere, where the same static buffers run eagerly (tests).
  enum class GraphMode { kAuto, kOff, kAlways };
  GraphMode graph_mode = GraphMode::kAuto;
  int max_loras = 4;                          // adapter slots
  std::int64_t max_lora_rank = 64;
  std::vector<std::int32_t> eos_ids;         // model EOS ids (stop unless ignore_eos)
  std::int64_t max_n = 64;                   // largest n accepted
  std::int64_t max_logprobs = 20;            // largest top-k logprobs accepted
  // Admission control: sequences (prompts x n) queued or running at most; submit() refuses more
  // with Unavailable (serve answers 429 with Retry-After). 0 = unbounded.
  std::int64_t max_queued_seqs = 0;
  // Health (health()): a step running longer than this, or `max_step_failures` failed steps in a
  // row within the last `failure_cooldown_s`, make the engine unhealthy.
  double step_timeout_s = 120;
  int max_step_failures = 3;
  double failure_cooldown_s = 30;
  // Fault injection for tests (LORASYNC_FAULTS in serve): called on the engine thread before each
  // forward with the step number; it may throw (the step fails) or sleep (the step hangs).
  std::function<void(std::int64_t step)> before_forward;
};

// What /health reports. `healthy` is false when the engine thread has stopped, a step has run past
// step_timeout_s, or the last max_step_failures steps failed (for failure_cooldown_s after the
// last one: a replica taken out of service gets another chance, like a circuit breaker).
struct EngineHealth {
  bool healthy = true;
  std::string reason;                    // why not healthy ("" when healthy)
  double step_running_s = 0;             // the current step's duration so far (0 between steps)
  std::int64_t consecutive_failures = 0;
  std::int64_t step_failures_total = 0;
  std::string last_error;
};

struct AdapterInfo {
  std::string name, path, sha256;
  std::int64_t rank = 0;
};

enum class PauseMode { kKeep, kAbort, kWait };

struct LoadOutcome {
  bool created = false;         // false: the same name and content were already loaded
  std::int64_t rank = 0;
  std::int64_t resident = 0;    // adapters resident after the load
  std::string sha256;
};

// A Prometheus-style histogram: counts[i] = observations <= bounds[i] (not cumulative), plus +Inf.
struct Histogram {
  std::vector<double> bounds;
  std::vector<std::int64_t> counts;  // bounds.size() + 1 (the last is +Inf)
  double sum = 0;
  std::int64_t count = 0;
  static Histogram latency();  // 1 ms .. 60 s
  void observe(double v);
};

struct EngineStats {
  std::int64_t running = 0, waiting = 0;
  std::int64_t kv_blocks_total = 0, kv_blocks_used = 0, kv_blocks_cached = 0;
  std::int64_t requests_total = 0, requests_finished = 0, requests_aborted = 0;
  std::int64_t prompt_tokens_total = 0, generated_tokens_total = 0;
  std::int64_t prefix_cache_hit_tokens = 0;  // prompt tokens whose KV came from the prefix cache
  std::int64_t fork_shared_tokens = 0;       // prompt tokens shared by n > 1 forks
  std::int64_t prefill_tokens_computed = 0;
  std::int64_t preemptions = 0, steps = 0;
  // All-decode steps run by the decode graphs (replayed, or eagerly on their buffers), and the
  // graphs captured (model/decode_graphs.h).
  std::int64_t decode_graph_steps = 0, decode_graph_captures = 0;
  std::int64_t adapter_loads = 0, adapter_load_failures = 0, adapter_unloads = 0;
  std::int64_t step_failures = 0, command_failures = 0, rejected_queue_full = 0;
  std::map<std::string, std::int64_t> requests_by_model;
  std::vector<double> ttft_s;          // recent time-to-first-token samples (bounded)
  std::vector<double> itl_s;           // recent inter-token latencies (bounded)
  Histogram ttft_hist = Histogram::latency();
  Histogram itl_hist = Histogram::latency();
};

class Engine {
 public:
  Engine(std::shared_ptr<const model::DecoderModel> model,
         std::shared_ptr<const tok::Tokenizer> tokenizer, EngineOptions opts);
  ~Engine();  // aborts everything and joins the thread
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const EngineOptions& options() const { return opts_; }
  std::int64_t kv_num_blocks() const;

  // Validates a request (InvalidInput naming the field, NotFound for an unknown model) and
  // queues it. Output arrives through spec.sink. Safe from any thread.
  void submit(RequestSpec spec);
  void validate(const RequestSpec& spec) const;
  // Unavailable ("the server is busy ...") when `seqs` more sequences would pass max_queued_seqs.
  // Call once per HTTP request before submitting its sub-requests (a soft limit: not a reservation).
  void check_capacity(std::int64_t seqs) const;
  // Ends a request (finish_reason "abort"); unknown ids are ignored.
  void abort(const std::string& request_id);

  // Installs an adapter read by read_adapter(). Conflict / Unavailable errors via the future.
  std::future<LoadOutcome> install_adapter(LoadedAdapter adapter);
  // Two-phase load (adapter push, docs/http-api.md). stage_adapter validates like install_adapter
  // and puts the weights in a free slot without making the name visible (prepare); the slot is
  // reclaimable by a later load once ttl_s has passed without a commit. created=false: the name
  // is already resident with this content, or already prepared with it (the deadline is renewed).
  // Conflict for other content under the name; Unavailable when no slot is free.
  std::future<LoadOutcome> stage_adapter(LoadedAdapter adapter, double ttl_s);
  // Makes a prepared name visible (a pointer swap between two steps). created=false when it is
  // already resident; NotFound when nothing is prepared under it (aborted, reclaimed, never sent).
  std::future<LoadOutcome> commit_adapter(const std::string& name);
  // Frees a prepared slot: "aborted", or "not_prepared" when there is none (idempotent).
  std::future<std::string> abort_staged(const std::string& name);
  // Slots holding prepared, uncommitted adapters.
  std::int64_t staged_adapters() const;
  // "unloaded" (slot freed now) or "draining"; NotFound for an unknown name (via the future).
  std::future<std::string> unload_adapter(const std::string& name);
  // The base model (parent empty) or a resident adapter.
  std::optional<AdapterInfo> find_adapter(const std::string& name) const;
  std::vector<AdapterInfo> adapters() const;  // resident, in load order

  void pause(PauseMode mode);
  void resume();
  bool is_paused() const;
  std::future<std::int64_t> reset_prefix_cache();

  EngineStats stats() const;
  bool alive() const;  // the engine thread runs
  EngineHealth health() const;

  struct Impl;

 private:
  std::future<LoadOutcome> place_adapter(LoadedAdapter adapter, bool staged, double ttl_s);

  EngineOptions opts_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorasync::engine
