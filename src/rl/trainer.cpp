#include "rl/trainer.h"

#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "core/io/checkpoint_dir.h"
#include "core/model/lora.h"
#include "core/model/qwen2_model.h"
#include "core/model/runtime.h"
#include "core/tokenizer/tokenizer.h"
#include "http/blocking_client.h"
#include "reward/reward_fn.h"
#include "rl/checkpoint.h"
#include "rl/config.h"
#include "rl/dataset.h"
#include "rl/grpo_loss.h"
#include "rl/metrics_endpoint.h"
#include "rl/optimizer.h"
#include "rl/packed_forward.h"
#include "rl/packing.h"
#include "rl/pipeline.h"
#include "rl/publisher.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/process.h"
#include "util/sha256.h"

#ifndef LORASYNC_VERSION
#define LORASYNC_VERSION "0.1.0"
#endif

namespace lorasync::rl {

std::atomic<int> g_stop_signal{0};

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }
double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

// Exit-code carrying errors.
struct ConfigRefusal : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct Preempted {};

[[noreturn]] void refuse(const std::string& msg) { throw ConfigRefusal(msg); }

// Appends lines to a JSONL file; byte offset for checkpoints.
class JsonlWriter {
 public:
  void open(const fs::path& p) {
    std::lock_guard lk(mu_);
    path_ = p;
    f_ = std::fopen(p.c_str(), "ab");
    if (!f_) throw_env("cannot open {} for appending", p.string());
  }
  ~JsonlWriter() {
    if (f_) std::fclose(f_);
  }
  void write(const std::string& line) {
    std::lock_guard lk(mu_);
    if (!f_) return;
    std::fwrite(line.data(), 1, line.size(), f_);
    std::fputc('\n', f_);
    std::fflush(f_);
  }
  std::uint64_t offset() {
    std::lock_guard lk(mu_);
    if (!f_) return 0;
    std::fflush(f_);
    ::fsync(fileno(f_));
    return static_cast<std::uint64_t>(std::ftell(f_));
  }

 private:
  std::mutex mu_;
  fs::path path_;
  std::FILE* f_ = nullptr;
};

// Cuts `path` to `offset`; the tail moves to <path>.orphaned-<restart>.
void truncate_with_orphans(const fs::path& path, std::uint64_t offset, std::int64_t restart) {
  if (!fs::exists(path)) return;
  const auto size = fs::file_size(path);
  if (size <= offset) return;
  std::string all = read_file(path);
  write_file_atomic(path.string() + ".orphaned-" + std::to_string(restart), all.substr(offset));
  fs::resize_file(path, offset);
}

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<std::int64_t>(s);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// Operational keys may change on resume (trainer.md §5).
TrainConfig with_operational(TrainConfig base, const TrainConfig& from) {
  base.max_steps = from.max_steps;
  base.generation.server_url = from.generation.server_url;
  base.generation.request_timeout_s = from.generation.request_timeout_s;
  base.generation.server_wait_s = from.generation.server_wait_s;
  base.logging = from.logging;
  base.checkpoint = from.checkpoint;
  base.async.max_inflight = from.async.max_inflight;
  base.async.queue_maxsize = from.async.queue_maxsize;
  base.async.score_workers = from.async.score_workers;
  base.model.threads = from.model.threads;
  return base;
}

}  // namespace

namespace {

class Trainer {
 public:
  explicit Trainer(const TrainArgs& args) : args_(args) {}
  int run();

 private:
  // ---- set-up
  void resolve_config();
  void prepare_output();
  void load_model_and_data();
  void wait_for_server();
  void probe_capabilities();
  void unload_leftovers(const std::set<std::int64_t>& keep);
  // ---- sync
  struct SyncJob {
    std::int64_t version = 0, sync_index = 0, step = 0;
    model::LoraAdapter snapshot;
  };
  struct SyncDone {
    std::int64_t version = 0;
    double save_s = 0, publish_s = 0, load_s = 0, total_s = 0;
  };
  void sync_thread_main();
  void run_sync(SyncJob& job);
  void load_adapter(const std::string& name, const fs::path& dir);
  bool unload_adapter(const std::string& name);
  void start_sync(std::int64_t step, const model::LoraAdapter* snapshot = nullptr);
  double wait_sync_idle();
  // ---- training
  void train_step(std::vector<Group>& groups, json& m);
  std::vector<Group> assemble_step(double& wait_s);
  std::vector<Group> assemble_step_into(std::vector<Group>& groups, double& wait_s);
  void write_checkpoint_now(bool final_ckpt);
  void restore_from(const fs::path& dir);
  void emit_metrics(json& m);
  void console(const json& m);
  void shutdown_pipeline();
  double lr_at(std::int64_t step) const;

  TrainArgs args_;
  TrainConfig cfg_;
  fs::path out_, ckpt_dir_, adapters_dir_;
  std::unique_ptr<model::Qwen2Model> model_;
  std::optional<tok::Tokenizer> tokenizer_;
  Dataset data_;
  c10::Device device_{c10::kCPU};
  model::LoraAdapter adapter_;
  std::unique_ptr<AdamW> opt_;
  std::shared_ptr<const reward::RewardFunction> reward_;
  std::vector<std::string> reward_names_;
  std::unique_ptr<Pipeline> pipe_;
  std::unique_ptr<AdapterPublisher> publisher_;
  std::unique_ptr<http::BlockingClient> client_;  // main thread
  std::unique_ptr<MetricsEndpoint> endpoint_;
  JsonlWriter metrics_, groups_log_;
  std::string served_model_, base_sha_;
  std::vector<std::int64_t> stop_ids_;
  LossConfig loss_cfg_;
  LossAgg agg_ = LossAgg::kSeqSumConst;

  std::int64_t step_ = 0, restarts_ = 0, next_version_ = 1;
  std::atomic<std::int64_t> event_step_{0};
  double loss_scale_ = 1.0;
  std::int64_t clean_steps_ = 0;
  std::map<std::int64_t, model::LoraAdapter> version_adapters_;  // window, for recompute
  std::optional<std::int64_t> pending_sync_version_;               // restored pending sync

  // Sync thread state.
  std::thread sync_thread_;
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  std::optional<SyncJob> sync_job_;
  bool sync_busy_ = false, sync_quit_ = false;
  std::vector<SyncDone> sync_done_;
  std::optional<std::string> sync_error_;
  std::set<std::int64_t> loaded_;           // versions loaded on the servers (guarded by sync_mu_)
  std::vector<std::int64_t> to_delete_;     // unloaded, deleted at the next sync (retention)
  std::unique_ptr<http::BlockingClient> sync_client_;

  double last_step_end_ = 0, run_start_ = 0, flops_ = 0;
  std::int64_t steps_this_run_ = 0;
  bool tty_ = false;
};

double Trainer::lr_at(std::int64_t step) const {
  const auto& o = cfg_.optimizer;
  double f = 1.0;
  if (o.warmup_steps > 0 && step < o.warmup_steps) f = static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  else if (o.scheduler == "cosine") {
    const double span = std::max<double>(1.0, static_cast<double>(cfg_.max_steps - o.warmup_steps));
    const double p = std::clamp(static_cast<double>(step - o.warmup_steps) / span, 0.0, 1.0);
    f = o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * p));
  }
  return o.lr * f;
}

void Trainer::resolve_config() {
  if (args_.resume) {
    fs::path dir;
    TrainConfig requested;
    bool have_requested = !args_.config_path.empty() || !args_.overrides.empty();
    if (have_requested) requested = TrainConfig::load(args_.config_path, args_.overrides);
    // The checkpoint is verified against its manifest once, here (find_resume_checkpoint checks
    // what it returns); restore_from reads it without hashing the files again.
    if (!args_.resume_dir.empty()) {
      dir = args_.resume_dir;
      std::string why;
      if (!checkpoint_complete(dir, &why)) refuse("--resume " + dir.string() + ": checkpoint is incomplete (" + why + ")");
    } else if (have_requested) {
      const fs::path ckpts = fs::path(requested.output_dir) / "checkpoints";
      auto found = find_resume_checkpoint(ckpts);
      if (!found) refuse("--resume: no complete checkpoint under " + ckpts.string());
      dir = *found;
    } else {
      refuse("--resume needs --config (to find output_dir) or a checkpoint directory");
    }
    json st = json::parse(read_file(dir / "state.json"));
    TrainConfig stored = TrainConfig::parse(st.at("config_toml").get<std::string>(), (dir / "state.json").string());
    if (have_requested) {
      TrainConfig merged = with_operational(stored, requested);
      if (merged.to_toml() != requested.to_toml() && !args_.resume_force)
        refuse("--resume: the configuration differs from the checkpoint's in keys that are not operational "
               "(only server URL, timeouts, logging, checkpoint cadence, max_steps, max_inflight, queue_maxsize, "
               "score_workers may change); pass --resume-force to accept");
      cfg_ = args_.resume_force ? requested : merged;
    } else {
      cfg_ = stored;
    }
    args_.resume_dir = dir.string();
  } else {
    if (args_.config_path.empty() && args_.overrides.empty()) refuse("--config FILE.toml is required");
    cfg_ = TrainConfig::load(args_.config_path, args_.overrides);
  }
  try {
    cfg_.validate();
  } catch (const Error& e) {
    refuse(e.what());
  }
}

void Trainer::prepare_output() {
  out_ = cfg_.output_dir;
  ckpt_dir_ = out_ / "checkpoints";
  adapters_dir_ = cfg_.sync.publish_dir.empty() ? out_ / "adapters" : fs::path(cfg_.sync.publish_dir);
  fs::create_directories(out_);
  if (!args_.resume && !args_.dry_run) {
    const bool has_ckpt = fs::exists(ckpt_dir_) && !fs::is_empty(ckpt_dir_);
    bool has_adapters = false;
    if (fs::exists(adapters_dir_))
      for (const auto& e : fs::directory_iterator(adapters_dir_))
        if (parse_version_name(e.path().filename().string(), cfg_.sync.adapter_prefix)) has_adapters = true;
    if ((has_ckpt || has_adapters) && !args_.overwrite)
      refuse("output_dir " + out_.string() + " already holds checkpoints or published adapters; use --resume to continue "
             "that run or --overwrite to start over");
    if (args_.overwrite) {
      std::error_code ec;
      fs::remove_all(ckpt_dir_, ec);
      for (const char* f : {"metrics.jsonl", "groups.jsonl"}) fs::remove(out_ / f, ec);
      fs::remove_all(out_ / "final_adapter", ec);
      // Published versions are removed after the leftovers are unloaded from the servers.
    }
  }
}

void Trainer::load_model_and_data() {
  device_ = model::parse_device(cfg_.model.device);
  const auto dtype = model::parse_dtype(cfg_.model.dtype, device_, "model.dtype");
  const int threads = cfg_.model.threads > 0 ? static_cast<int>(cfg_.model.threads)
                                             : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (device_.is_cpu()) model::set_compute_threads(threads);
  const fs::path mp = cfg_.model.path;
  if (!fs::exists(mp / "config.json")) refuse("model.path " + mp.string() + ": no config.json (expected a local Hugging Face directory)");
  tokenizer_ = tok::Tokenizer::load(mp);
  model_ = model::Qwen2Model::load(mp, dtype, device_);
  base_sha_ = io::model_identity_sha256(mp);
  DatasetOptions dopt;
  dopt.problem_key = cfg_.data.problem_key;
  dopt.answer_key = cfg_.data.answer_key;
  dopt.prompt_format = cfg_.data.prompt_format;
  dopt.system_prompt = cfg_.data.system_prompt;
  dopt.max_prompt_tokens = cfg_.data.max_prompt_tokens;
  try {
    data_ = load_dataset(cfg_.data.train_file, *tokenizer_, dopt);
  } catch (const Error& e) {
    refuse(std::string(e.what()));
  }
  if (data_.problems.empty()) refuse("data.train_file " + cfg_.data.train_file + ": no usable problems");
  if (data_.skipped_long > 0)
    LS_LOG_WARN("trainer", "{} prompts longer than data.max_prompt_tokens = {} were skipped", data_.skipped_long, cfg_.data.max_prompt_tokens);
  // Stop tokens: configured, else the model's EOS ids plus <|im_end|> for chatml.
  stop_ids_ = cfg_.generation.stop_token_ids;
  if (stop_ids_.empty()) {
    for (auto id : model_->config().eos_token_ids) stop_ids_.push_back(id);
    if (cfg_.data.prompt_format == "chatml")
      if (auto id = tokenizer_->token_to_id("<|im_end|>")) stop_ids_.push_back(*id);
    std::sort(stop_ids_.begin(), stop_ids_.end());
    stop_ids_.erase(std::unique(stop_ids_.begin(), stop_ids_.end()), stop_ids_.end());
  }
  // Rewards.
  std::vector<std::pair<std::shared_ptr<const reward::RewardFunction>, double>> parts;
  for (std::size_t i = 0; i < cfg_.grpo.reward_funcs.size(); ++i) {
    try {
      parts.emplace_back(reward::make_reward_function(cfg_.grpo.reward_funcs[i]), cfg_.grpo.reward_weights[i]);
    } catch (const Error& e) {
      refuse(std::string("grpo.reward_funcs: ") + e.what());
    }
    reward_names_.push_back(cfg_.grpo.reward_funcs[i]);
  }
  reward_ = parts.size() == 1 && parts[0].second == 1.0 ? parts[0].first : std::make_shared<reward::CompositeReward>(parts);
  loss_cfg_.eps_low = cfg_.grpo.epsilon_low;
  loss_cfg_.eps_high = cfg_.grpo.epsilon_high;
  loss_cfg_.tis_cap = cfg_.grpo.tis_cap;
  loss_cfg_.beta = cfg_.grpo.beta;
  loss_cfg_.old_policy = parse_old_policy(cfg_.grpo.old_policy);
  agg_ = parse_loss_agg(cfg_.grpo.loss_agg);
}

void Trainer::wait_for_server() {
  const double deadline = now_s() + cfg_.generation.server_wait_s;
  std::string last;
  for (;;) {
    auto r = client_->request("GET", "/health", {}, 10);
    if (r.status == 200) return;
    if (r.status == 401 || r.status == 403) refuse("server " + cfg_.generation.server_url + " refused the API key (HTTP " +
                                                   std::to_string(r.status) + "): set LORASYNC_API_KEY or --api-key");
    last = r.status ? "HTTP " + std::to_string(r.status) + ": " + http::error_message_of(r.body) : r.message;
    if (now_s() > deadline || g_stop_signal.load())
      throw Error(ErrorKind::kUnavailable, "server " + cfg_.generation.server_url + " is unreachable after " +
                                               fmt::format("{:.0f}", cfg_.generation.server_wait_s) + " s (" + last +
                                               "): start it, or fix generation.server_url / raise generation.server_wait_s");
    std::this_thread::sleep_for(std::chrono::milliseconds(cfg_.generation.server_wait_s < 10 ? 200 : 2000));
  }
}

void Trainer::probe_capabilities() {
  auto r = client_->request("GET", "/server_info?config_format=json", {}, 30);
  if (r.status != 200)
    refuse("GET /server_info on " + cfg_.generation.server_url + " failed (" + (r.status ? "HTTP " + std::to_string(r.status) : r.message) +
           "): the trainer needs it to check LoRA support (vLLM: set VLLM_SERVER_DEV_MODE=1)");
  json info = json::parse(r.body, nullptr, false);
  if (info.is_discarded()) refuse("GET /server_info returned invalid JSON");
  const json* lora = nullptr;
  if (info.contains("lora_config")) lora = &info["lora_config"];
  else if (info.contains("vllm_config") && info["vllm_config"].contains("lora_config")) lora = &info["vllm_config"]["lora_config"];
  if (!lora || lora->is_null())
    refuse("the server has LoRA disabled (lora_config is null): start `lorasync serve` with --max-loras >= " +
           std::to_string(cfg_.async.max_staleness + 2) + " (vLLM: --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)");
  const auto max_rank = lora->value("max_lora_rank", std::int64_t{0});
  if (max_rank < cfg_.lora.rank)
    refuse(fmt::format("the server's max_lora_rank is {} but lora.rank is {}: restart the server with --max-lora-rank {} "
                       "(or lower lora.rank)", max_rank, cfg_.lora.rank, cfg_.lora.rank));
  const auto max_loras = lora->value("max_loras", std::int64_t{0});
  std::int64_t need = cfg_.async.max_staleness + 2;
  if (max_loras < need)
    refuse(fmt::format("the server's max_loras is {} but the run needs max_staleness + 2 = {} adapter slots: restart the "
                       "server with --max-loras {} (or lower async.max_staleness)", max_loras, need, need));
  if (lora->contains("max_cpu_loras") && (*lora)["max_cpu_loras"].is_number() && (*lora)["max_cpu_loras"].get<std::int64_t>() < need)
    refuse(fmt::format("the server's max_cpu_loras is {} but the run needs {}: raise --max-cpu-loras", (*lora)["max_cpu_loras"].get<std::int64_t>(), need));
  if (lora->contains("target_modules") && (*lora)["target_modules"].is_array()) {
    std::set<std::string> supported;
    for (const auto& t : (*lora)["target_modules"]) supported.insert(t.get<std::string>());
    for (auto m : model::LoraConfig::parse_targets(cfg_.lora.target_modules))
      if (!supported.count(std::string(model::lora_module_name(m))))
        refuse("lora.target_modules includes " + std::string(model::lora_module_name(m)) + ", which the server does not support");
  }
  const json* par = info.contains("parallel_config") ? &info["parallel_config"] : nullptr;
  if (par && par->value("data_parallel_size", 1) > 1)
    refuse("the server runs data_parallel_size > 1: an adapter load would reach one rank only; run one replica per "
           "process behind `lorasync proxy`");
  const auto mml = info.value("max_model_len", std::int64_t{0});
  if (mml > 0 && mml < cfg_.generation.context_len)
    refuse(fmt::format("the server's max_model_len is {} but generation.context_len is {}: restart it with "
                       "--max-model-len {} (or lower generation.context_len)", mml, cfg_.generation.context_len, cfg_.generation.context_len));
  served_model_ = info.value("model", std::string());
  if (!cfg_.model.served_name.empty() && served_model_ != cfg_.model.served_name)
    refuse("the server serves model '" + served_model_ + "' but model.served_name is '" + cfg_.model.served_name +
           "': point generation.server_url at the right server or fix model.served_name");
  if (info.contains("base_model_sha256") && info["base_model_sha256"].is_string() && info["base_model_sha256"] != base_sha_)
    refuse("the server's base model (sha256 " + info["base_model_sha256"].get<std::string>().substr(0, 12) +
           "...) is not the trainer's model.path (" + base_sha_.substr(0, 12) + "...): both must load the same weights");
  const std::string sdtype = info.value("dtype", std::string());
  if (!sdtype.empty() && sdtype != model::dtype_name(model_->dtype()))
    LS_LOG_WARN("trainer", "the servers compute in {} but model.dtype is {}: expect ratio != 1", sdtype, model::dtype_name(model_->dtype()));
}

void Trainer::unload_leftovers(const std::set<std::int64_t>& keep) {
  std::set<std::string> names;
  auto r = client_->request("GET", "/v1/models", {}, 30);
  if (r.status == 200) {
    json j = json::parse(r.body, nullptr, false);
    if (!j.is_discarded() && j.contains("data"))
      for (const auto& m : j["data"])
        if (m.contains("id") && m["id"].is_string()) names.insert(m["id"].get<std::string>());
  }
  for (auto v : publisher_->existing_versions()) names.insert(publisher_->name_of(v));
  for (const auto& n : names) {
    auto v = parse_version_name(n, cfg_.sync.adapter_prefix);
    if (!v || keep.count(*v)) continue;
    unload_adapter(n);
  }
}

bool Trainer::unload_adapter(const std::string& name) {
  auto& c = sync_client_ ? *sync_client_ : *client_;
  auto r = c.request("POST", "/v1/unload_lora_adapter", json{{"lora_name", name}}.dump(), 60, true);
  if (r.status != 200 && r.status != 404) {
    LS_LOG_WARN("trainer", "unloading {} failed: {}", name, r.status ? http::error_message_of(r.body) : r.message);
    return false;
  }
  return true;
}

void Trainer::load_adapter(const std::string& name, const fs::path& dir) {
  const fs::path server_dir = cfg_.sync.server_publish_dir.empty() ? dir : fs::path(cfg_.sync.server_publish_dir) / name;
  const double deadline = now_s() + cfg_.sync.adapter_load_deadline;
  auto& c = sync_client_ ? *sync_client_ : *client_;
  if (cfg_.sync.pause_during_load) c.request("POST", "/pause?mode=keep", "{}", 60, true);
  for (;;) {
    auto r = c.request("POST", "/v1/load_lora_adapter", json{{"lora_name", name}, {"lora_path", server_dir.string()}}.dump(),
                       cfg_.sync.adapter_load_deadline + 30, true);
    if (r.status == 200) break;
    const std::string msg = r.status ? http::error_message_of(r.body) : r.message;
    const bool lagging = r.status == 404 && msg.find("No adapter found") != std::string::npos;
    const bool transient = r.status == 0 || r.status == 429 || r.status >= 500;
    if ((!lagging && !transient) || now_s() > deadline) {
      if (cfg_.sync.pause_during_load) c.request("POST", "/resume", "{}", 60, true);
      throw Error(ErrorKind::kUnavailable, "loading adapter " + name + " failed (" +
                                               (r.status ? "HTTP " + std::to_string(r.status) : std::string("transport")) + "): " + msg);
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(cfg_.sync.adapter_retry_interval));
  }
  if (cfg_.sync.pause_during_load) c.request("POST", "/resume", "{}", 60, true);
}

void Trainer::run_sync(SyncJob& job) {
  const double t0 = now_s();
  SyncDone d;
  d.version = job.version;
  Published p = publisher_->publish(job.snapshot, job.version, job.step);
  d.save_s = p.save_s;
  d.publish_s = p.publish_s;
  VersionInfo vi{job.version, job.sync_index, p.name, p.adapter_sha256};
  pipe_->add_version(vi);
  const double l0 = now_s();
  load_adapter(p.name, p.dir);
  d.load_s = now_s() - l0;
  {
    std::lock_guard lk(sync_mu_);
    loaded_.insert(job.version);
  }
  pipe_->switch_to(job.version);
  // Retention: delete the directories unloaded at the previous sync, then unload drained versions
  // beyond the window (their directories go at the next sync).
  std::vector<std::int64_t> deleting;
  {
    std::lock_guard lk(sync_mu_);
    deleting.swap(to_delete_);
  }
  for (auto v : deleting) publisher_->remove_version(v);
  std::set<std::int64_t> loaded;
  {
    std::lock_guard lk(sync_mu_);
    loaded = loaded_;
  }
  for (auto v : loaded) {
    if (v == job.version) continue;
    auto info = pipe_->version(v);
    const std::int64_t k = info ? info->sync_index : 0;
    if (job.sync_index - k <= cfg_.async.max_staleness) continue;
    if (pipe_->in_flight_uses(v)) continue;  // tried again at the next sync
    if (unload_adapter(publisher_->name_of(v))) {
      std::lock_guard lk(sync_mu_);
      loaded_.erase(v);
      to_delete_.push_back(v);
    }
  }
  d.total_s = now_s() - t0;
  std::lock_guard lk(sync_mu_);
  sync_done_.push_back(d);
}

void Trainer::sync_thread_main() {
  for (;;) {
    SyncJob job;
    {
      std::unique_lock lk(sync_mu_);
      sync_cv_.wait(lk, [&] { return sync_quit_ || sync_job_.has_value(); });
      if (!sync_job_) return;
      job = std::move(*sync_job_);
      sync_job_.reset();
    }
    try {
      run_sync(job);
    } catch (const std::exception& e) {
      std::lock_guard lk(sync_mu_);
      sync_error_ = e.what();
    }
    std::lock_guard lk(sync_mu_);
    sync_busy_ = false;
    sync_cv_.notify_all();
  }
}

double Trainer::wait_sync_idle() {
  const double t0 = now_s();
  std::unique_lock lk(sync_mu_);
  sync_cv_.wait(lk, [&] { return !sync_busy_; });
  if (sync_error_) throw Error(ErrorKind::kUnavailable, "weight sync failed: " + *sync_error_);
  return now_s() - t0;
}

void Trainer::start_sync(std::int64_t step, const model::LoraAdapter* snapshot) {
  SyncJob job;
  {
    auto cur = pipe_->current();
    job.sync_index = (cur ? cur->sync_index : -1) + 1;
  }
  job.version = next_version_++;
  job.step = step;
  job.snapshot = snapshot ? snapshot->clone() : adapter_.clone();
  version_adapters_[job.version] = job.snapshot.clone();
  std::lock_guard lk(sync_mu_);
  sync_busy_ = true;
  sync_job_ = std::move(job);
  sync_cv_.notify_all();
}

std::vector<Group> Trainer::assemble_step(double& wait_s) {
  std::vector<Group> groups;
  try {
    return assemble_step_into(groups, wait_s);
  } catch (...) {
    pipe_->unpop(std::move(groups));  // a partial step returns to the queue (and to a checkpoint)
    throw;
  }
}

std::vector<Group> Trainer::assemble_step_into(std::vector<Group>& groups, double& wait_s) {
  std::int64_t samples = 0;
  const double t0 = now_s();
  for (;;) {
    while (samples < cfg_.batching.samples_per_step) {
      if (g_stop_signal.load()) throw Preempted{};
      if (auto f = pipe_->fatal()) throw Error(ErrorKind::kInvalidInput, *f);
      {
        std::lock_guard lk(sync_mu_);
        if (sync_error_) throw Error(ErrorKind::kUnavailable, "weight sync failed: " + *sync_error_);
      }
      auto g = pipe_->pop(0.25);
      if (!g) {
        if (pipe_->exhausted()) break;
        if (pipe_->seconds_since_success() > cfg_.async.server_down_s)
          throw Error(ErrorKind::kUnavailable, fmt::format("no rollout request succeeded for {:.0f} s (async.server_down_s): "
                                                           "the servers are down or unreachable", cfg_.async.server_down_s));
        continue;
      }
      const std::int64_t s = pipe_->staleness_of(*g);
      if (s > cfg_.async.max_staleness) {
        pipe_->drop_stale(*g, s);
        continue;
      }
      samples += static_cast<std::int64_t>(g->members.size());
      groups.push_back(std::move(*g));
    }
    // Final re-check just before the first forward: a switch may have happened meanwhile.
    bool dropped = false;
    for (auto it = groups.begin(); it != groups.end();) {
      const std::int64_t s = pipe_->staleness_of(*it);
      if (s > cfg_.async.max_staleness) {
        pipe_->drop_stale(*it, s);
        samples -= static_cast<std::int64_t>(it->members.size());
        it = groups.erase(it);
        dropped = true;
      } else {
        ++it;
      }
    }
    if (!dropped || pipe_->exhausted()) break;
  }
  wait_s = now_s() - t0;
  return std::move(groups);
}

void Trainer::train_step(std::vector<Group>& groups, json& m) {
  const auto& cfg = cfg_;
  const double temp = cfg.generation.temperature;
  std::vector<PackedSample> items;
  std::vector<const Member*> members;
  std::vector<std::int64_t> versions;
  std::vector<PackItem> pack;
  std::int64_t total_completion = 0, total_tokens = 0, gi = 0;
  for (const auto& g : groups) {
    const Problem* pr = find_problem(data_, g.prompt.index);
    LS_CHECK(pr, "group for an unknown prompt");
    std::int64_t mi = 0;
    for (const auto& mem : g.members) {
      PackedSample s;
      s.prompt = pr->prompt_ids;
      s.completion.assign(mem.ids.begin(), mem.ids.end());
      pack.push_back({static_cast<std::int64_t>(s.prompt.size() + s.completion.size()), gi, mi++});
      total_completion += static_cast<std::int64_t>(s.completion.size());
      total_tokens += static_cast<std::int64_t>(s.prompt.size() + s.completion.size());
      items.push_back(std::move(s));
      members.push_back(&mem);
      versions.push_back(g.version);
    }
    ++gi;
  }
  const auto n = static_cast<std::int64_t>(items.size());
  const double K = static_cast<double>(cfg.grpo.loss_norm_const > 0 ? cfg.grpo.loss_norm_const : cfg.generation.max_new_tokens);
  const double denom = agg_ == LossAgg::kTokenMean ? static_cast<double>(std::max<std::int64_t>(1, total_completion))
                                                   : static_cast<double>(n) * K;
  PackPlan plan = plan_rows(pack, cfg.batching.row_tokens);
  const auto opts = torch::TensorOptions().device(device_);
  // Old-policy pass (recompute): the trainer's logprobs under each sample's version, no grad.
  std::vector<at::Tensor> old_lp(static_cast<std::size_t>(n)), ref_lp(static_cast<std::size_t>(n));
  double recompute_s = 0, fwd_s = 0;
  if (loss_cfg_.old_policy == OldPolicy::kRecompute || loss_cfg_.beta > 0) {
    const double t0 = now_s();
    torch::NoGradGuard ng;
    for (const auto& row : plan.rows) {
      std::map<std::int64_t, std::vector<std::size_t>> by_version;
      for (auto i : row) by_version[versions[i]].push_back(i);
      if (loss_cfg_.old_policy == OldPolicy::kRecompute) {
        for (const auto& [v, idx] : by_version) {
          auto it = version_adapters_.find(v);
          LS_CHECK(it != version_adapters_.end(), "no snapshot of a version in the staleness window");
          std::vector<PackedSample> sub;
          for (auto i : idx) sub.push_back(items[i]);
          auto out = model::packed_logprobs(*model_, &it->second, sub, temp, cfg.batching.logits_chunk);
          for (std::size_t k = 0; k < idx.size(); ++k)
            old_lp[idx[k]] = out.logprobs.slice(0, out.offsets[k], out.offsets[k + 1]);
        }
      }
      if (loss_cfg_.beta > 0) {
        std::vector<PackedSample> sub;
        for (auto i : row) sub.push_back(items[i]);
        auto out = model::packed_logprobs(*model_, nullptr, sub, temp, cfg.batching.logits_chunk);
        for (std::size_t k = 0; k < row.size(); ++k) ref_lp[row[k]] = out.logprobs.slice(0, out.offsets[k], out.offsets[k + 1]);
      }
    }
    recompute_s = now_s() - t0;
  }
  // Gradient pass, one row at a time; each row adds its partial sum over the global denominator.
  LossStats stats;
  double J = 0, ent_sum = 0;
  const double t_fb = now_s();
  for (const auto& row : plan.rows) {
    std::vector<PackedSample> sub;
    std::vector<float> beh, adv;
    for (auto i : row) {
      sub.push_back(items[i]);
      beh.insert(beh.end(), members[i]->logprobs.begin(), members[i]->logprobs.end());
      adv.insert(adv.end(), members[i]->ids.size(), static_cast<float>(members[i]->advantage));
    }
    const double f0 = now_s();
    auto out = packed_row_logprobs(*model_, &adapter_, sub, temp, cfg.batching.logits_chunk);
    fwd_s += now_s() - f0;
    const auto fdt = out.logprobs.scalar_type();
    TokenInputs in;
    in.logp = out.logprobs;
    in.behaviour = torch::from_blob(beh.data(), {static_cast<std::int64_t>(beh.size())}, torch::kFloat32).to(opts.dtype(fdt));
    in.advantages = torch::from_blob(adv.data(), {static_cast<std::int64_t>(adv.size())}, torch::kFloat32).to(opts.dtype(fdt));
    if (loss_cfg_.old_policy == OldPolicy::kRecompute) {
      std::vector<at::Tensor> parts;
      for (auto i : row) parts.push_back(old_lp[i]);
      in.old = torch::cat(parts).to(fdt);
    }
    if (loss_cfg_.beta > 0) {
      std::vector<at::Tensor> parts;
      for (auto i : row) parts.push_back(ref_lp[i]);
      in.ref = torch::cat(parts).to(fdt);
    }
    LossStats rs;
    at::Tensor L = grpo_token_losses(in, loss_cfg_, &rs);
    stats.merge(rs);
    at::Tensor loss = L.sum() / denom;
    J += loss.item<double>();
    if (out.entropy.defined()) ent_sum += out.entropy.sum().item<double>();
    (loss * loss_scale_).backward();
  }
  const double fwd_bwd_s = now_s() - t_fb;
  // Optimizer: unscale (fp16), clip, AdamW.
  const double o0 = now_s();
  auto params = adapter_.parameters();
  bool finite = true;
  if (loss_scale_ != 1.0)
    for (auto& p : params)
      if (p.grad().defined()) p.grad().div_(loss_scale_);
  double gnorm = clip_grad_norm(params, cfg.optimizer.max_grad_norm);
  if (!std::isfinite(gnorm)) finite = false;
  const bool fp16 = model_->dtype() == torch::kFloat16;
  if (!finite && fp16) {
    loss_scale_ = std::max(1.0, loss_scale_ / 2);
    clean_steps_ = 0;
    pipe_->add_counter("skipped_steps_total", 1);
  } else if (!finite) {
    throw Error(ErrorKind::kInternal, fmt::format("non-finite gradient norm at step {} (loss {})", step_ + 1, J));
  } else {
    opt_->step(lr_at(opt_->steps()));
    if (fp16 && ++clean_steps_ >= cfg.optimizer.loss_scale_window) loss_scale_ *= 2, clean_steps_ = 0;
  }
  opt_->zero_grad();
  const double optimizer_s = now_s() - o0;

  // Metrics of the step's samples.
  double rsum = 0, rstd_sum = 0, zero_std = 0, clipped = 0;
  std::int64_t minlen = std::numeric_limits<std::int64_t>::max(), maxlen = 0;
  std::vector<double> part_sums(reward_names_.size(), 0.0);
  double stale_sum = 0, stale_max = 0, tq = 0;
  const double tnow = now_s();
  for (const auto& g : groups) {
    double gm = 0, gs = 0;
    for (const auto& mem : g.members) gm += mem.reward;
    gm /= static_cast<double>(g.members.size());
    for (const auto& mem : g.members) gs += (mem.reward - gm) * (mem.reward - gm);
    gs = std::sqrt(gs / static_cast<double>(g.members.size()));
    rstd_sum += gs;
    if (gs == 0) zero_std += 1;
    const auto s = static_cast<double>(pipe_->staleness_of(g));
    for (const auto& mem : g.members) {
      rsum += mem.reward;
      if (mem.finish == "length") clipped += 1;
      minlen = std::min<std::int64_t>(minlen, static_cast<std::int64_t>(mem.ids.size()));
      maxlen = std::max<std::int64_t>(maxlen, static_cast<std::int64_t>(mem.ids.size()));
      for (std::size_t k = 0; k < part_sums.size() && k < mem.parts.size(); ++k) part_sums[k] += mem.parts[k];
      stale_sum += s;
      stale_max = std::max(stale_max, s);
      tq += tnow - g.enqueued_at;
    }
  }
  const double dn = static_cast<double>(std::max<std::int64_t>(1, n));
  const double nt = static_cast<double>(std::max<std::int64_t>(1, stats.n_tokens));
  m["loss"] = J;
  m["grad_norm"] = gnorm;
  m["learning_rate"] = lr_at(std::max<std::int64_t>(0, opt_->steps() - 1));
  if (fp16) m["loss_scale"] = loss_scale_;
  m["reward"] = rsum / dn;
  for (std::size_t k = 0; k < reward_names_.size(); ++k) m["rewards/" + reward_names_[k]] = part_sums[k] / dn;
  m["reward_std"] = rstd_sum / static_cast<double>(groups.size());
  m["frac_reward_zero_std"] = zero_std / static_cast<double>(groups.size());
  m["completions/mean_length"] = static_cast<double>(total_completion) / dn;
  m["completions/min_length"] = minlen;
  m["completions/max_length"] = maxlen;
  m["completions/clipped_ratio"] = clipped / dn;
  m["ratio"] = stats.ratio_sum / nt;
  m["ratio/min"] = stats.ratio_min;
  m["ratio/max"] = stats.ratio_max;
  m["clip_ratio/low_mean"] = stats.clip_low / nt;
  m["clip_ratio/high_mean"] = stats.clip_high / nt;
  m["clip_ratio/region_mean"] = (stats.clip_low + stats.clip_high) / nt;
  m["tis/weight_mean"] = stats.tis_weight_sum / nt;
  m["tis/clip_frac"] = stats.tis_clipped / nt;
  m["entropy"] = ent_sum / nt;
  if (loss_cfg_.beta > 0) m["kl"] = stats.kl_sum / nt;
  m["mismatch/kl"] = stats.mismatch_k3_sum / nt;
  m["mismatch/kl_k1"] = stats.mismatch_k1_sum / nt;
  m["mismatch/prob_diff_max"] = stats.prob_diff_max;
  m["mismatch/prob_diff_min"] = stats.prob_diff_min;
  m["perf/fwd_s"] = fwd_s;
  m["perf/fwd_bwd_s"] = fwd_bwd_s;
  if (loss_cfg_.old_policy == OldPolicy::kRecompute || loss_cfg_.beta > 0) m["perf/recompute_s"] = recompute_s;
  m["perf/optimizer_s"] = optimizer_s;
  m["sample/staleness_mean"] = stale_sum / dn;
  m["sample/staleness_max"] = stale_max;
  m["sample/time_in_queue_s"] = tq / dn;
  // MFU (trainer.md §6): F = sum_i (4 P L_i + 6 n_layers d_attn L_i^2) + 4 d V C; omitted on CPU.
  if (!device_.is_cpu() && cfg.logging.peak_tflops > 0) {
    const auto& c = model_->config();
    const double P = static_cast<double>(c.num_hidden_layers) *
                     static_cast<double>(c.hidden_size * c.q_dim() * 2 + 2 * c.hidden_size * c.num_key_value_heads * c.head_dim +
                                         3 * c.hidden_size * c.intermediate_size);
    double F = 4.0 * static_cast<double>(c.hidden_size) * static_cast<double>(c.vocab_size) * static_cast<double>(total_completion);
    for (const auto& it : pack)
      F += 4.0 * P * static_cast<double>(it.length) +
           6.0 * static_cast<double>(c.num_hidden_layers * c.q_dim()) * static_cast<double>(it.length) * static_cast<double>(it.length);
    m["perf/mfu_fwd_bwd"] = 100.0 * F / (std::max(1e-9, fwd_bwd_s) * cfg.logging.peak_tflops * 1e12);
    flops_ = F;
  }
  m["batch/samples_per_step"] = n;
  m["batch/tokens_per_step"] = total_tokens;
  m["batch/microbatches_per_step"] = plan.rows.size();
  m["batch/samples_per_row"] = dn / static_cast<double>(std::max<std::size_t>(1, plan.rows.size()));
  m["batch/row_fill_frac"] = plan.fill;
  m["batch/row_imbalance"] = plan.imbalance;
}

void Trainer::console(const json& m) {
  auto num = [&](const char* k) { return m.contains(k) && m[k].is_number() ? m[k].get<double>() : std::nan(""); };
  const double elapsed = now_s() - run_start_;
  const double per = steps_this_run_ > 0 ? elapsed / static_cast<double>(steps_this_run_) : std::nan("");
  const double eta = per * static_cast<double>(cfg_.max_steps - step_);
  const std::string line = fmt::format(
      "step {}/{}  reward {:.3f}  ratio {:.5f}  staleness {:.2f}  {:.2f} s/step  queue {}  v{}  ETA {}", step_, cfg_.max_steps,
      num("reward"), num("ratio"), num("sample/staleness_mean"), num("perf/step_s"), static_cast<std::int64_t>(num("sample/rollout_queue_size")),
      m.value("version", std::int64_t{0}), fmt_duration(eta));
  if (tty_) std::fprintf(stderr, "\r\033[K%s", line.c_str());
  else if (cfg_.logging.log_every > 0 && step_ % cfg_.logging.log_every == 0) std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

void Trainer::emit_metrics(json& m) {
  metrics_.write(m.dump(-1, ' ', false, json::error_handler_t::replace));
  if (endpoint_) {
    std::map<std::string, double> vals;
    for (const auto& [k, v] : m.items())
      if (v.is_number()) vals[k] = v.get<double>();
    endpoint_->publish(prometheus_text(vals));
  }
  console(m);
}

void Trainer::write_checkpoint_now(bool final_ckpt) {
  const double t0 = now_s();
  PipelineState ps = pipe_->capture();
  CheckpointData d;
  d.step = step_;
  d.adapter = &adapter_;
  d.exp_avg = opt_->exp_avg();
  d.exp_avg_sq = opt_->exp_avg_sq();
  for (const auto& [v, a] : version_adapters_) d.version_tensors[v] = a.parameters();
  d.groups = std::move(ps.groups);
  json vers = json::array();
  for (const auto& v : ps.versions) vers.push_back({{"version", v.version}, {"sync_index", v.sync_index}, {"name", v.name}, {"sha256", v.sha256}});
  std::set<std::int64_t> loaded;
  std::optional<std::int64_t> pending;
  {
    std::lock_guard lk(sync_mu_);
    loaded = loaded_;
  }
  // A sync whose switch has not happened yet is stored as pending (its snapshot is in versions).
  if (!version_adapters_.empty() && version_adapters_.rbegin()->first > ps.current) pending = version_adapters_.rbegin()->first;
  const std::string cfg_toml = cfg_.to_toml();
  d.state = {{"time", unix_now()},
             {"restarts", restarts_},
             {"next_version", next_version_},
             {"current_version", ps.current},
             {"loaded", std::vector<std::int64_t>(loaded.begin(), loaded.end())},
             {"versions", vers},
             {"pending_sync_version", pending ? json(*pending) : json(nullptr)},
             {"cursor", cursor_to_json(ps.cursor)},
             {"counters", ps.counters},
             {"samples_since_switch", ps.samples_since_switch},
             {"optimizer_steps", opt_->steps()},
             {"scheduler", {{"name", cfg_.optimizer.scheduler}, {"optimizer_steps", opt_->steps()}}},
             {"loss_scaler", {{"scale", loss_scale_}, {"clean_steps", clean_steps_}}},
             {"rng", {{"seed", cfg_.seed}}},
             {"metrics_offset", metrics_.offset()},
             {"groups_offset", groups_log_.offset()},
             {"config_toml", cfg_toml},
             {"config_sha256", sha256_hex(cfg_toml)},
             {"program_version", LORASYNC_VERSION}};
  write_checkpoint(ckpt_dir_, d, cfg_.checkpoint.save_total_limit, final_ckpt ? std::optional<std::int64_t>(step_) : std::nullopt);
  LS_LOG_INFO("trainer", "checkpoint step {} written in {:.2f} s", step_, now_s() - t0);
}

void Trainer::restore_from(const fs::path& dir) {
  CheckpointData d = read_checkpoint(dir, /*verified=*/true);
  const json& st = d.state;
  step_ = d.step;
  restarts_ = st.value("restarts", std::int64_t{0}) + 1;
  adapter_ = model::LoraAdapter::load_peft(d.adapter_dir, model_->config(), device_);
  adapter_.set_requires_grad(true);
  AdamWConfig ac{cfg_.optimizer.betas[0], cfg_.optimizer.betas[1], cfg_.optimizer.eps, cfg_.optimizer.weight_decay};
  opt_ = std::make_unique<AdamW>(adapter_.parameters(), ac);
  std::vector<at::Tensor> mm, vv;
  for (auto& t : d.exp_avg) mm.push_back(t.to(device_));
  for (auto& t : d.exp_avg_sq) vv.push_back(t.to(device_));
  opt_->load_state(mm, vv, st.at("optimizer_steps").get<std::int64_t>());
  loss_scale_ = st.at("loss_scaler").at("scale").get<double>();
  clean_steps_ = st.at("loss_scaler").at("clean_steps").get<std::int64_t>();
  for (auto& [v, ts] : d.version_tensors) {
    model::LoraAdapter a = adapter_.clone();
    auto ps = a.parameters();
    LS_CHECK(ps.size() == ts.size(), "checkpoint version tensors do not match the adapter");
    for (std::size_t i = 0; i < ps.size(); ++i) ps[i].copy_(ts[i]);
    version_adapters_[v] = std::move(a);
  }
  // Metrics files: cut what was written after the checkpoint.
  truncate_with_orphans(out_ / "metrics.jsonl", st.at("metrics_offset").get<std::uint64_t>(), restarts_);
  truncate_with_orphans(out_ / "groups.jsonl", st.at("groups_offset").get<std::uint64_t>(), restarts_);
  PipelineState ps;
  ps.cursor = cursor_from_json(st.at("cursor"));
  ps.groups = std::move(d.groups);
  ps.counters = st.at("counters").get<std::map<std::string, std::int64_t>>();
  for (const auto& v : st.at("versions"))
    ps.versions.push_back({v.at("version").get<std::int64_t>(), v.at("sync_index").get<std::int64_t>(), v.at("name").get<std::string>(),
                           v.at("sha256").get<std::string>()});
  ps.current = st.at("current_version").get<std::int64_t>();
  ps.samples_since_switch = st.value("samples_since_switch", std::int64_t{0});
  next_version_ = st.at("next_version").get<std::int64_t>();
  if (!st.at("pending_sync_version").is_null()) {
    const auto pv = st.at("pending_sync_version").get<std::int64_t>();
    pending_sync_version_ = pv;
  }
  pipe_->restore(std::move(ps));
}

void Trainer::shutdown_pipeline() {
  if (pipe_) pipe_->stop();
}

int Trainer::run() {
  configure_process();
  tty_ = ::isatty(2) != 0;
  resolve_config();
  prepare_output();
  load_model_and_data();
  std::string key = args_.api_key;
  client_ = std::make_unique<http::BlockingClient>(cfg_.generation.server_url, key);
  sync_client_ = nullptr;
  wait_for_server();
  probe_capabilities();
  if (args_.dry_run) {
    std::printf("%s\n", json{{"event", "dry_run_ok"}, {"server", cfg_.generation.server_url}, {"model", served_model_},
                             {"problems", data_.problems.size()}}.dump().c_str());
    return 0;
  }
  publisher_ = std::make_unique<AdapterPublisher>(adapters_dir_, cfg_.sync.adapter_prefix, cfg_.model.served_name.empty() ? served_model_ : cfg_.model.served_name, base_sha_);
  fs::create_directories(adapters_dir_);
  publisher_->remove_stale_staging();
  remove_checkpoint_staging(ckpt_dir_);

  // Files of the run.
  write_file_atomic(out_ / "config.toml", cfg_.to_toml());
  const fs::path mfile = cfg_.logging.metrics_file.empty() ? out_ / "metrics.jsonl" : fs::path(cfg_.logging.metrics_file);

  PipelineOptions po;
  po.cfg = cfg_;
  po.server_url = cfg_.generation.server_url;
  po.api_key = key;
  po.vocab = model_->config().vocab_size;
  po.stop_ids = stop_ids_;
  po.prefix = cfg_.sync.adapter_prefix;
  pipe_ = std::make_unique<Pipeline>(po, data_, *tokenizer_, reward_, [this](const GroupEvent& e) {
    if (!cfg_.logging.group_log) return;
    json j = {{"step", event_step_.load()}, {"prompt", e.prompt.index}, {"epoch", e.prompt.epoch}, {"attempt", e.prompt.attempt},
              {"version", e.version}, {"sync_index", e.sync_index}, {"staleness", e.staleness}, {"disposition", e.disposition},
              {"reward", e.mean_reward}, {"tokens", e.tokens}};
    groups_log_.write(j.dump());
  });

  std::set<std::int64_t> keep;
  std::optional<std::int64_t> restored_current;
  std::int64_t restored_k = -1;
  if (args_.resume) {
    restore_from(args_.resume_dir);
    auto cur = pipe_->current();
    LS_CHECK(cur.has_value(), "checkpoint without a current version");
    restored_current = cur->version;
    restored_k = cur->sync_index;
    // Next number: above everything published or listed by the servers (never reused).
    std::int64_t hi = next_version_ - 1;
    for (auto v : publisher_->existing_versions()) hi = std::max(hi, v);
    auto r = client_->request("GET", "/v1/models", {}, 30);
    if (r.status == 200) {
      json j = json::parse(r.body, nullptr, false);
      if (!j.is_discarded() && j.contains("data"))
        for (const auto& mdl : j["data"])
          if (mdl.contains("id") && mdl["id"].is_string())
            if (auto v = parse_version_name(mdl["id"].get<std::string>(), cfg_.sync.adapter_prefix)) hi = std::max(hi, *v);
    }
    next_version_ = hi + 1;
  } else {
    if (cfg_.lora.init_adapter.empty()) {
      model::LoraConfig lc;
      lc.rank = cfg_.lora.rank;
      lc.alpha = cfg_.lora.alpha;
      lc.targets = model::LoraConfig::parse_targets(cfg_.lora.target_modules);
      lc.base_model_name_or_path = cfg_.model.served_name.empty() ? served_model_ : cfg_.model.served_name;
      adapter_ = model::LoraAdapter::init(lc, model_->config(), static_cast<std::uint64_t>(cfg_.seed), device_);
    } else {
      adapter_ = model::LoraAdapter::load_peft(cfg_.lora.init_adapter, model_->config(), device_);
      if (adapter_.config().rank != cfg_.lora.rank)
        refuse(fmt::format("lora.init_adapter has rank {} but lora.rank is {}", adapter_.config().rank, cfg_.lora.rank));
    }
    adapter_.set_requires_grad(true);
    AdamWConfig ac{cfg_.optimizer.betas[0], cfg_.optimizer.betas[1], cfg_.optimizer.eps, cfg_.optimizer.weight_decay};
    opt_ = std::make_unique<AdamW>(adapter_.parameters(), ac);
    pipe_->init_fresh();
    if (model_->dtype() == torch::kFloat16) loss_scale_ = cfg_.optimizer.loss_scale_init;  // dynamic loss scaling
    if (cfg_.optimizer.scheduler != "constant" && cfg_.optimizer.scheduler != "cosine")
      refuse("optimizer.scheduler must be constant or cosine; got \"" + cfg_.optimizer.scheduler + "\"");
  }
  // Leftover versions of this prefix are unloaded (and, on a fresh run, deleted).
  unload_leftovers({});
  if (!args_.resume) {
    for (auto v : publisher_->existing_versions()) publisher_->remove_version(v);
  }
  metrics_.open(mfile);
  if (cfg_.logging.group_log) groups_log_.open(out_ / "groups.jsonl");
  write_file_atomic(out_ / "run.json", json{{"run_name", cfg_.run_name}, {"start_time", unix_now()}, {"restarts", restarts_},
                                            {"program_version", LORASYNC_VERSION}, {"resumed_from", args_.resume ? args_.resume_dir : ""}}.dump(1));

  // Sync thread with its own client.
  sync_client_ = std::make_unique<http::BlockingClient>(cfg_.generation.server_url, key);
  sync_thread_ = std::thread([this] { sync_thread_main(); });
  struct Joiner {
    Trainer* t;
    ~Joiner() {
      {
        std::lock_guard lk(t->sync_mu_);
        t->sync_quit_ = true;
        t->sync_cv_.notify_all();
      }
      if (t->sync_thread_.joinable()) t->sync_thread_.join();
    }
  } joiner{this};

  // Version 1 (fresh) or the re-announcement of the checkpoint's current version (resume).
  {
    SyncJob job;
    job.version = next_version_++;
    job.step = step_;
    job.snapshot = adapter_.clone();
    if (restored_current) {
      job.sync_index = restored_k;  // same sync index: staleness does not jump
      job.snapshot = version_adapters_.at(*restored_current).clone();
    } else {
      job.sync_index = 0;
    }
    version_adapters_[job.version] = job.snapshot.clone();
    run_sync(job);
    std::lock_guard lk(sync_mu_);
    sync_done_.clear();
  }
  // After a resume, every other version of the run is unloaded (nothing is in flight yet).
  if (restored_current) {
    auto cur = pipe_->current();
    unload_leftovers({cur->version});
    std::lock_guard lk(sync_mu_);
    loaded_ = {cur->version};
    for (auto v : publisher_->existing_versions())  // retention: deleted at the next sync
      if (v != cur->version) to_delete_.push_back(v);
  }
  if (cfg_.logging.metrics_port != 0) {
    endpoint_ = std::make_unique<MetricsEndpoint>(cfg_.logging.metrics_bind,
                                                  static_cast<std::uint16_t>(cfg_.logging.metrics_port < 0 ? 0 : cfg_.logging.metrics_port));
  }
  std::printf("%s\n", json{{"event", "started"}, {"step", step_}, {"version", pipe_->current()->version}, {"restarts", restarts_},
                           {"metrics_port", endpoint_ ? endpoint_->port() : 0}, {"output_dir", out_.string()}}.dump().c_str());
  std::fflush(stdout);
  pipe_->start();
  if (pending_sync_version_) {  // the checkpoint's pending sync runs as a normal sync, under a new number
    auto it = version_adapters_.find(*pending_sync_version_);
    if (it != version_adapters_.end()) {
      model::LoraAdapter snap = std::move(it->second);
      version_adapters_.erase(it);
      start_sync(step_, &snap);
    }
    pending_sync_version_.reset();
  }

  run_start_ = now_s();
  last_step_end_ = now_s();
  double sync_wait_carry = 0, ckpt_carry = 0;
  try {
    while (step_ < cfg_.max_steps) {
      event_step_ = step_ + 1;
      double wait_s = 0;
      std::vector<Group> groups = assemble_step(wait_s);
      if (groups.empty()) break;  // data exhausted
      json m;
      ++step_;
      ++steps_this_run_;
      train_step(groups, m);
      pipe_->record_trained(groups);
      double sync_wait = sync_wait_carry;
      sync_wait_carry = 0;
      if (step_ % cfg_.sync.weight_sync_steps == 0) {
        sync_wait += wait_sync_idle();  // at most one sync at a time
        start_sync(step_);
        if (cfg_.sync.blocking) sync_wait += wait_sync_idle();
      }
      // Prune snapshots outside the staleness window (keep pending and loaded ones).
      {
        auto cur = pipe_->current();
        std::set<std::int64_t> loaded;
        {
          std::lock_guard lk(sync_mu_);
          loaded = loaded_;
        }
        for (auto it = version_adapters_.begin(); it != version_adapters_.end();) {
          auto info = pipe_->version(it->first);
          const bool old = info && cur && cur->sync_index - info->sync_index > cfg_.async.max_staleness && !loaded.count(it->first);
          it = old ? version_adapters_.erase(it) : std::next(it);
        }
      }
      // Metrics.
      const double t = now_s();
      auto cur = pipe_->current();
      m["step"] = step_;
      m["time"] = unix_now();
      m["epoch"] = pipe_->dispatched_fraction();
      m["version"] = cur ? cur->version : 0;
      m["sync_index"] = cur ? cur->sync_index : 0;
      m["restarts"] = restarts_;
      m["perf/step_s"] = t - last_step_end_;
      m["perf/rollout_wait_s"] = wait_s;
      m["perf/weight_sync_wait_s"] = sync_wait;
      if (flops_ > 0) m["perf/mfu_wall_clock"] = 100.0 * flops_ / (std::max(1e-9, t - last_step_end_) * cfg_.logging.peak_tflops * 1e12);
      if (ckpt_carry > 0) m["perf/checkpoint_s"] = ckpt_carry;
      ckpt_carry = 0;
      m["perf/tokens_per_s"] = m["batch/tokens_per_step"].get<double>() / std::max(1e-9, t - last_step_end_);
      {
        std::lock_guard lk(sync_mu_);
        if (!sync_done_.empty()) {
          const auto& d = sync_done_.back();
          m["perf/weight_sync_s"] = d.total_s;
          m["perf/weight_sync_save_s"] = d.save_s;
          m["perf/weight_sync_publish_s"] = d.publish_s;
          m["perf/weight_sync_load_s"] = d.load_s;
          sync_done_.clear();
        }
      }
      const WindowStats w = pipe_->take_window();
      const double win = std::max(1e-9, t - last_step_end_);
      m["sample/rollout_queue_size"] = pipe_->queue_samples();
      m["rollout/inflight"] = pipe_->inflight_sequences();
      m["rollout/generated_tok_s"] = static_cast<double>(w.generated_tokens) / win;
      m["rollout/backpressure_s"] = w.backpressure_s;
      m["rollout/score_block_s"] = w.score_block_s;
      m["rollout/admission_block_s"] = w.admission_block_s;
      if (w.requests) m["rollout/request_s"] = w.request_s_sum / static_cast<double>(w.requests);
      if (w.scored_groups) m["rollout/score_s"] = w.score_s_sum / static_cast<double>(w.scored_groups);
      for (const auto& [k, v] : pipe_->counters()) m[k] = v;
      last_step_end_ = t;
      emit_metrics(m);
      // Checkpoint after the step's metrics line (its offset includes the line); the time it
      // takes is reported with the next step.
      if (step_ % cfg_.checkpoint.save_steps == 0 && step_ < cfg_.max_steps) {
        const double c0 = now_s();
        sync_wait_carry += wait_sync_idle();
        write_checkpoint_now(false);
        ckpt_carry = now_s() - c0;
      }
    }
    if (tty_) std::fprintf(stderr, "\n");
    // End of run: wait for the sync, final checkpoint, final adapter, unload everything.
    wait_sync_idle();
    shutdown_pipeline();
    write_checkpoint_now(true);
    adapter_.save_peft(out_ / "final_adapter", true);
    std::set<std::int64_t> loaded;
    {
      std::lock_guard lk(sync_mu_);
      loaded = loaded_;
    }
    for (auto v : loaded) unload_adapter(publisher_->name_of(v));
    std::printf("%s\n", json{{"event", "finished"}, {"step", step_}, {"final_adapter", (out_ / "final_adapter").string()}}.dump().c_str());
    std::fflush(stdout);
    return 0;
  } catch (const Preempted&) {
    if (tty_) std::fprintf(stderr, "\n");
    LS_LOG_WARN("trainer", "preempted (signal): writing a checkpoint at step {}", step_);
    shutdown_pipeline();
    if (!cfg_.checkpoint.save_on_sigterm) return 143;
    try {
      write_checkpoint_now(false);
    } catch (const std::exception& e) {
      LS_LOG_ERROR("trainer", "checkpoint on preemption failed: {}", e.what());
      return 1;
    }
    return 143;
  } catch (const std::exception& e) {
    if (tty_) std::fprintf(stderr, "\n");
    LS_LOG_ERROR("trainer", "{}", e.what());
    shutdown_pipeline();
    try {
      write_checkpoint_now(false);
    } catch (const std::exception& e2) {
      LS_LOG_ERROR("trainer", "could not write a checkpoint: {}", e2.what());
    }
    std::fprintf(stderr, "lorasync train: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int run_trainer(const TrainArgs& args) {
  try {
    Trainer t(args);
    return t.run();
  } catch (const ConfigRefusal& e) {
    std::fprintf(stderr, "lorasync train: configuration error: %s\n", e.what());
    return 2;
  } catch (const Error& e) {
    const bool config = e.kind() == ErrorKind::kInvalidInput || e.kind() == ErrorKind::kNotFound || e.kind() == ErrorKind::kUnsupported;
    std::fprintf(stderr, "lorasync train: %s%s\n", config ? "configuration error: " : "error: ", e.what());
    return config ? 2 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorasync train: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace lorasync::rl
