#include "demo/train_config.h"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <sstream>

namespace lorasync::demo {

std::filesystem::path default_cache_dir() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  return xdg && *xdg ? std::filesystem::path(xdg) / "lorasync" : std::filesystem::path(home ? home : ".") / ".cache" / "lorasync";
}

std::filesystem::path cached_model_dir(const std::filesystem::path& cache, std::int64_t seed, std::int64_t sft_steps,
                                       const std::string& arch) {
  return cache / ("demo-model-v2-seed" + std::to_string(seed) + (sft_steps > 0 ? "-sft" + std::to_string(sft_steps) : std::string()) +
                  (arch != "qwen2" ? "-" + arch : std::string()));
}

std::string demo_train_toml(const DemoTrainSettings& s) {
  auto q = [](const std::string& v) { return nlohmann::json(v).dump(); };
  // A TOML float always (16.0, not 16): the reader takes floats where the schema has them.
  auto num = [](double v) {
    std::string t = nlohmann::json(v).dump();
    if (t.find_first_of(".eE") == std::string::npos) t += ".0";
    return t;
  };
  std::ostringstream f;
  f << "run_name = \"lorasync-demo\"\n"
    << "output_dir = " << q(s.output_dir) << "\n"
    << "seed = " << s.seed << "\nmax_steps = " << s.max_steps << "\n"
    << "[model]\npath = " << q(s.model_path) << "\nserved_name = " << q(s.served_name) << "\ndevice = " << q(s.device)
    << "\ndtype = \"fp32\"\nthreads = 1\n"
    << "[lora]\nrank = " << s.lora_rank << "\nalpha = " << num(s.lora_alpha) << "\n"
    << "[data]\ntrain_file = " << q(s.train_file) << "\nsystem_prompt = " << q(s.system_prompt) << "\nmax_prompt_tokens = 200\n"
    << "[generation]\nserver_url = " << q(s.server_url) << "\nmax_new_tokens = " << s.max_new_tokens
    << "\ntemperature = " << num(s.temperature) << "\ncontext_len = 512\nserver_wait_s = 60\n"
    << "[grpo]\nnum_generations = " << s.num_generations
    << "\nold_policy = " << q(s.old_policy) << "\ntis_cap = 2.0\nloss_agg = \"seq_sum_const\"\n"
    << "[async]\nmax_inflight = 64\nqueue_maxsize = 128\nscore_workers = 2\nmax_staleness = " << s.max_staleness << "\n"
    << "[batching]\nsamples_per_step = " << s.samples_per_step << "\nrow_tokens = 4096\nlogits_chunk = 512\n"
    << "[optimizer]\nlr = " << num(s.lr) << "\nmax_grad_norm = 1.0\n"
    << "[sync]\nweight_sync_steps = " << s.sync_every << "\nadapter_retry_interval = 0.1\ntransport = " << q(s.sync_transport) << "\n"
    << "[checkpoint]\nsave_steps = " << s.save_steps << "\nsave_total_limit = " << s.save_total_limit << "\n"
    << "[logging]\nmetrics_port = 0\nlog_every = 1\n";
  return f.str();
}

}  // namespace lorasync::demo
