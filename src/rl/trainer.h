// rl/trainer.h: `lorasync train`, the asynchronous GRPO trainer (trainer.md): start-up checks and
// capability probe, the step loop (assembly with the staleness re-check, packing, recompute/KL
// passes, loss, accumulation, clipping, AdamW, fp16 loss scaling), weight sync on its own thread
// (publish -> load -> switch -> unload drained -> delete later), checkpoints and lossless resume,
// metrics (metrics.jsonl, groups.jsonl, Prometheus, console line).
// Exit codes: 0 done, 1 runtime error, 2 configuration or capability refusal, 143 preempted.
// Thread-safety: run_trainer owns its threads; one call per process.
#pragma once

#include <atomic>
#include <string>
#include <vector>

namespace lorasync::rl {

struct TrainArgs {
  std::string config_path;               // may be empty with --resume (the stored config is used)
  std::vector<std::string> overrides;    // --set section.key=value, in order
  bool resume = false;
  std::string resume_dir;                // explicit checkpoint; empty = latest complete
  bool resume_force = false;
  bool overwrite = false;
  bool dry_run = false;
  std::string api_key;                   // bearer token for the server/proxy (LORASYNC_API_KEY)
};

// Set by the signal handler: 1 after the first SIGTERM/SIGINT.
extern std::atomic<int> g_stop_signal;

int run_trainer(const TrainArgs& args);

}  // namespace lorasync::rl
