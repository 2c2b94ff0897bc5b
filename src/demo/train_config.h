// demo/train_config.h: the trainer configuration of the demo's run (demo.md), written as TOML for
// `lorasync train --config`, and where the demo caches its base models. `lorasync demo` and
// `lorasync bench e2e` (which races the run against TRL with the same hyperparameters) both take
// them from here.
// Thread-safety: pure functions (default_cache_dir reads the environment).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace lorasync::demo {

struct DemoTrainSettings {
  std::string output_dir;
  std::int64_t seed = 1;
  std::int64_t max_steps = 160;
  std::string model_path;
  std::string served_name = "demo-base";
  std::string device = "cpu";
  std::string train_file;
  std::string system_prompt;
  std::string server_url;
  std::int64_t max_new_tokens = 64;
  double temperature = 1.0;
  std::int64_t num_generations = 8;    // G
  std::int64_t samples_per_step = 32;  // completions per optimizer step
  std::int64_t lora_rank = 8;
  double lora_alpha = 16.0;
  double lr = 5e-4;
  std::int64_t max_staleness = 2;  // in weight syncs
  std::int64_t sync_every = 2;     // optimizer steps between weight syncs
  std::string sync_transport = "auto";
  std::string old_policy = "recompute";  // grpo.old_policy
  std::int64_t save_steps = 5;
  std::int64_t save_total_limit = 3;
};

// $XDG_CACHE_HOME/lorasync, else ~/.cache/lorasync.
std::filesystem::path default_cache_dir();
// The cached base model's folder in `cache` (what `make-demo-model --out` wrote): one per seed, SFT
// steps (0 = make-demo-model's default) and family.
std::filesystem::path cached_model_dir(const std::filesystem::path& cache, std::int64_t seed, std::int64_t sft_steps,
                                       const std::string& arch = "qwen2");

// The TOML text (every string quoted as JSON, which TOML reads the same).
std::string demo_train_toml(const DemoTrainSettings& s);

}  // namespace lorasync::demo
