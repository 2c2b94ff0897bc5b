// `lorasync bench e2e` (time to accuracy): lorasync, TRL's AsyncGRPOTrainer against the same
// lorasync fleet, and TRL's synchronous GRPOTrainer with its own generation, on the same task,
// model and hyperparameters, raced to a held-out accuracy (docs/benchmarks.md, "Time to accuracy").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorasync::cli {

struct RaceOptions {
  std::string systems = "lorasync,trl-async,trl-sync";
  std::string seeds = "1,2,3";
  double budget_s = 900;          // wall-time cap of each run
  std::int64_t max_steps = 160;   // step cap of each run (the demo's)
  double target = 0.7;            // held-out accuracy to reach
  std::int64_t save_steps = 8;    // adapter snapshot every N steps (each evaluated afterwards)
  std::int64_t eval_problems = 256, eval_samples = 2;
  double eval_temperature = 1.0;  // the demo's evaluation (its base model boxes 40 % of answers)
  // The task: the demo's (made and cached as `lorasync demo` does), or any model and data by flag.
  std::string demo_dir;           // a make-demo-model folder (default: the demo's cache)
  std::int64_t model_seed = 1;
  std::int64_t model_steps = 0;   // SFT steps when making the demo model (0 = its default)
  std::string model, train_data, heldout_data, system_prompt;  // override the demo's
  std::int64_t max_new_tokens = 0;                              // 0 = the demo's (64)
  // Hyperparameters shared by every system.
  std::int64_t num_generations = 8, samples_per_step = 32, lora_rank = 8;
  double lora_alpha = 16.0, lr = 5e-4, temperature = 1.0;
  std::int64_t max_staleness = 2;  // in weight syncs (TRL's unit is steps: x sync_every)
  std::int64_t sync_every = 2;     // optimizer steps between weight syncs
  // lorasync's old policy: step_start, the trainer-bound remedy (trainer.md): no recompute pass, as
  // neither TRL trainer has one (GRPOTrainer's old policy is the step's own, AsyncGRPOTrainer's the
  // sampler's); the demo's recompute is a flag away.
  std::string lorasync_old_policy = "step_start";
  std::vector<std::string> lorasync_set;  // extra `lorasync train --set KEY=VALUE` for the lorasync runs
  std::string python;              // default: the project's .venv
  std::string out = "runs/bench-e2e";
};

int run_race(const RaceOptions& o);

}  // namespace lorasync::cli
