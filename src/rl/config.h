// rl/config.h: the trainer's configuration (trainer.md §7): built-in defaults < TOML file <
// `--set section.key=value` overrides (values parsed as TOML), applied in order. Unknown keys and
// wrong types are errors naming the key; validate() applies the documented rules (exit code 2).
// to_toml() writes the resolved configuration (the run's config.toml).
// Thread-safety: a value type.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "rl/external_reward.h"

namespace lorasync::rl {

struct TrainConfig {
  std::string run_name = "lorasync";
  std::string output_dir = "runs/lorasync";
  std::int64_t seed = 42;
  std::int64_t max_steps = 500;
  struct Model {
    std::string path, served_name, device = "cuda", dtype = "bf16", attention = "auto";
    std::int64_t threads = 0;  // CPU compute threads; 0 = all cores (extension)
  } model;
  struct Lora {
    std::int64_t rank = 1;
    double alpha = 2.0, dropout = 0.0;
    std::vector<std::string> target_modules = {"all-linear"};
    std::string init_adapter;
  } lora;
  struct Data {
    std::string train_file, problem_key = "problem", answer_key = "answer", prompt_format = "chatml";
    std::string system_prompt = "Please reason step by step, and put your final answer within \\boxed{}.";
    std::int64_t max_prompt_tokens = 1024;
    bool shuffle = true;
    std::int64_t epochs = 0;
    bool enable_thinking = true;  // prompt_format "qwen3": false pre-fills an empty <think> block
  } data;
  struct Generation {
    std::string server_url = "http://127.0.0.1:8000", request_mode = "group";
    std::int64_t max_new_tokens = 3000, context_len = 4096;
    double temperature = 1.0, top_p = 1.0;
    std::int64_t top_k = 0;
    std::vector<std::int64_t> stop_token_ids;
    bool seed_requests = true;
    double request_timeout_s = 1200, server_wait_s = 900;
  } generation;
  struct Grpo {
    std::int64_t num_generations = 8;
    std::vector<std::string> reward_funcs = {"math_boxed"};
    std::vector<double> reward_weights = {1.0};
    double reward_timeout_s = 2.0, reward_on_timeout = 0.0, truncated_reward = 0.0;
    std::string advantage = "dr_grpo", loss_agg = "seq_sum_const";
    std::int64_t loss_norm_const = 0;
    double epsilon_low = 0.2, epsilon_high = 0.2;
    std::string old_policy = "recompute";
    double tis_cap = 2.0, beta = 0.0;
  } grpo;
  struct Async {
    std::int64_t max_inflight = 256, queue_maxsize = 512, score_workers = 8, score_queue_groups = 32;
    std::int64_t max_staleness = 4;
    bool requeue_dropped = true;
    std::int64_t max_prompt_attempts = 3, max_retries = 8;
    double retry_backoff_s = 1.0, retry_backoff_max_s = 30.0, server_down_s = 900;
    bool ordered = false;
  } async;
  struct Batching {
    std::string mode = "count";
    std::int64_t samples_per_step = 128, step_token_budget = 0, row_tokens = 16384, logits_chunk = 2048;
    bool activation_checkpointing = false;
  } batching;
  struct Optimizer {
    double lr = 4e-5;
    std::vector<double> betas = {0.9, 0.95};
    double eps = 1e-8, weight_decay = 0.0, max_grad_norm = 1.0;
    std::string scheduler = "constant";
    std::int64_t warmup_steps = 0;
    double min_lr_ratio = 0.0, loss_scale_init = 65536.0;
    std::int64_t loss_scale_window = 1000;
  } optimizer;
  struct Sync {
    std::int64_t weight_sync_steps = 4;
    std::string publish_dir, server_publish_dir, adapter_prefix = "policy";
    double adapter_retry_interval = 0.5, adapter_load_deadline = 300;
    bool blocking = false, pause_during_load = false;
    // How a version reaches the servers: "path" (load_lora_adapter from the bucket), "push" (its
    // bytes over HTTP, two-phase through the proxy), "auto" (push where /server_info offers it).
    std::string transport = "auto";
  } sync;
  struct Checkpoint {
    std::int64_t save_steps = 50, save_total_limit = 3;
    bool save_on_sigterm = true;
  } checkpoint;
  struct Logging {
    std::string metrics_file, metrics_bind = "127.0.0.1";
    bool group_log = true;
    std::int64_t metrics_port = 9400, log_every = 1;
    double peak_tflops = 989.5;
  } logging;

  // Multi-turn environments (rl/environment.h, docs/environments.md): with a command, every
  // rollout is an episode against a worker of that program; without one, single-turn completions
  // scored by grpo.reward_funcs.
  struct Env {
    std::vector<std::string> command;  // argv; empty = no environment
    std::string workdir;
    std::vector<std::string> environment;  // extra variables for the workers, "NAME=value"
    std::int64_t workers = 8;          // episodes talking to their environment at once
    double timeout_s = 30, startup_s = 60, cpu_s = 3600;
    std::int64_t memory_mb = 4096;
    bool network = false;
    std::int64_t max_turns = 4;              // model turns per episode
    std::int64_t max_episode_tokens = 0;     // tokens after the first prompt (0 = generation.context_len)
    std::int64_t max_observation_tokens = 2048;  // one environment turn's tokens
    std::int64_t max_output_bytes = 4 << 20;     // one answer line
    double episode_deadline_s = 1800;        // wall time of one episode, model turns included
    std::int64_t rows = 0;  // without data.train_file: rows 0..rows-1 (an environment that makes its own tasks)
  } env;

  // External rewards, [rewards.NAME] tables (rl/external_reward.h), named in grpo.reward_funcs like
  // the built-in ones: kind, command, workdir, url, bearer_token_env, workers, timeout_s, startup_s, cpu_s,
  // memory_mb, network, max_output_bytes. `--set rewards.NAME.key=value` works as elsewhere.
  std::map<std::string, ExternalRewardOptions> rewards;

  // Defaults < file (may be empty) < overrides ("section.key=value", values in TOML syntax).
  // InvalidInput naming the file/override and the key on any problem.
  static TrainConfig load(const std::string& toml_path, const std::vector<std::string>& overrides);
  static TrainConfig parse(const std::string& toml_text, const std::string& label,
                           const std::vector<std::string>& overrides = {});
  // The documented validation rules; InvalidInput naming the keys and values.
  void validate() const;
  std::string to_toml() const;
};

}  // namespace lorasync::rl
