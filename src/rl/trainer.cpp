#include "rl/trainer.h"

#include "rl/trainer_impl.h"
#include "rl/server_caps.h"

#include "core/tokenizer/chat_template.h"

namespace lorasync::rl {

std::atomic<int> g_stop_signal{0};

namespace detail {

namespace {

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

void Trainer::resolve_config() {
  if (args_.resume) {
    fs::path dir;
    TrainConfig requested;
    bool have_requested = !args_.config_path.empty() || !args_.overrides.empty();
    // With --config, the file is the requested configuration; with --set alone, the overrides
    // apply on top of the checkpoint's own configuration (`--resume DIR --set max_steps=800`).
    if (!args_.config_path.empty()) requested = TrainConfig::load(args_.config_path, args_.overrides);
    // The checkpoint is verified against its manifest once, here (find_resume_checkpoint checks
    // what it returns); restore_from reads it without hashing the files again.
    if (!args_.resume_dir.empty()) {
      dir = args_.resume_dir;
      std::string why;
      if (!checkpoint_complete(dir, &why)) refuse("--resume " + dir.string() + ": checkpoint is incomplete (" + why + ")");
    } else if (have_requested) {
      const TrainConfig locate = args_.config_path.empty() ? TrainConfig::load("", args_.overrides) : requested;
      const fs::path ckpts = fs::path(locate.output_dir) / "checkpoints";
      auto found = find_resume_checkpoint(ckpts);
      if (!found) refuse("--resume: no complete checkpoint under " + ckpts.string());
      dir = *found;
    } else {
      refuse("--resume needs --config (to find output_dir) or a checkpoint directory");
    }
    json st = json::parse(read_file(dir / "state.json"));
    TrainConfig stored = TrainConfig::parse(st.at("config_toml").get<std::string>(), (dir / "state.json").string());
    if (args_.config_path.empty() && have_requested)
      requested = TrainConfig::parse(st.at("config_toml").get<std::string>(), (dir / "state.json").string(), args_.overrides);
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
      for (const char* f : {"metrics.jsonl", "groups.jsonl", "episodes.jsonl"}) fs::remove(out_ / f, ec);
      fs::remove_all(out_ / "final_adapter", ec);
      // Published versions are removed after the leftovers are unloaded from the servers.
    }
  }
}

void Trainer::load_model_and_data() {
  device_ = prepare_training_device(cfg_, dist_env_ ? dist_env_->local_rank : -1);
  if (dist_) LS_LOG_INFO("trainer", "data-parallel gradients all-reduced by {}", dist_->use_device(device_));
  const auto dtype = model::parse_dtype(cfg_.model.dtype, device_, "model.dtype");
  const fs::path mp = cfg_.model.path;
  if (!fs::exists(mp / "config.json")) refuse("model.path " + mp.string() + ": no config.json (expected a local Hugging Face directory)");
  tokenizer_ = tok::Tokenizer::load(mp);
  model_ = model::DecoderModel::load(mp, dtype, device_);
  base_sha_ = io::model_identity_sha256(mp);
  try {
    check_row_fits(cfg_, model_->config(), model_->dtype(), device_, "");
  } catch (const Error& e) {
    refuse(e.what());
  }
  DatasetOptions dopt;
  dopt.problem_key = cfg_.data.problem_key;
  dopt.answer_key = cfg_.data.answer_key;
  dopt.prompt_format = cfg_.data.prompt_format;
  dopt.enable_thinking = cfg_.data.enable_thinking;
  dopt.system_prompt = cfg_.data.system_prompt;
  dopt.max_prompt_tokens = cfg_.data.max_prompt_tokens;
  try {
    // An environment that makes its own tasks (env.rows): rows 0..N-1 with nothing but an index.
    data_ = cfg_.data.train_file.empty() && cfg_.env.rows > 0 ? index_dataset(cfg_.env.rows)
                                                              : load_dataset(cfg_.data.train_file, *tokenizer_, dopt);
  } catch (const Error& e) {
    refuse(std::string(e.what()));
  }
  if (data_.problems.empty()) refuse("data.train_file " + cfg_.data.train_file + ": no usable problems");
  if (data_.skipped_long > 0)
    LS_LOG_WARN("trainer", "{} prompts longer than data.max_prompt_tokens = {} were skipped", data_.skipped_long, cfg_.data.max_prompt_tokens);
  // Stop tokens: configured, else the model's EOS ids plus the chat format's end of turn
  // (<|im_end|> for chatml and qwen3, <|eot_id|> for llama3).
  stop_ids_ = cfg_.generation.stop_token_ids;
  if (stop_ids_.empty()) {
    for (auto id : model_->config().eos_token_ids) stop_ids_.push_back(id);
    if (cfg_.data.prompt_format != "raw")
      for (std::string_view s : tok::chat_stop_tokens(tok::parse_chat_format(cfg_.data.prompt_format, "data.prompt_format")))
        if (auto id = tokenizer_->token_to_id(s)) stop_ids_.push_back(*id);
    std::sort(stop_ids_.begin(), stop_ids_.end());
    stop_ids_.erase(std::unique(stop_ids_.begin(), stop_ids_.end()), stop_ids_.end());
  }
  // Rewards.
  std::vector<std::pair<std::shared_ptr<const reward::RewardFunction>, double>> parts;
  for (std::size_t i = 0; i < cfg_.grpo.reward_funcs.size(); ++i) {
    try {
      const std::string& fname = cfg_.grpo.reward_funcs[i];
      auto ext = cfg_.rewards.find(fname);
      parts.emplace_back(ext != cfg_.rewards.end() ? make_external_reward(ext->second)
                                                   : reward::make_reward_function(fname),
                         cfg_.grpo.reward_weights[i]);
    } catch (const Error& e) {
      refuse(std::string("grpo.reward_funcs: ") + e.what());
    }
    reward_names_.push_back(cfg_.grpo.reward_funcs[i]);
  }
  reward_ = parts.size() == 1 && parts[0].second == 1.0 ? parts[0].first : std::make_shared<reward::CompositeReward>(parts);
  loss_cfg_ = loss_config_of(cfg_);
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
  ServerCaps caps;
  try {
    caps = parse_server_info(info);
  } catch (const Error& e) {
    refuse(e.what());
  }
  const std::int64_t need = cfg_.async.max_staleness + 2;
  if (!caps.lora_enabled)
    refuse("the server has LoRA disabled (lora_config is null): start `lorasync serve` with --max-loras >= " +
           std::to_string(need) + " (vLLM: --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)");
  if (caps.max_lora_rank < cfg_.lora.rank)
    refuse(fmt::format("the server's max_lora_rank is {} but lora.rank is {}: restart the server with --max-lora-rank {} "
                       "(or lower lora.rank)", caps.max_lora_rank, cfg_.lora.rank, cfg_.lora.rank));
  if (caps.max_loras < need)
    refuse(fmt::format("the server's max_loras is {} but the run needs max_staleness + 2 = {} adapter slots: restart the "
                       "server with --max-loras {} (or lower async.max_staleness)", caps.max_loras, need, need));
  if (caps.max_cpu_loras && *caps.max_cpu_loras < need)
    refuse(fmt::format("the server's max_cpu_loras is {} but the run needs {}: raise --max-cpu-loras", *caps.max_cpu_loras, need));
  if (caps.target_modules) {
    const std::set<std::string> supported(caps.target_modules->begin(), caps.target_modules->end());
    for (auto m : model::LoraConfig::parse_targets(cfg_.lora.target_modules))
      if (!supported.count(std::string(model::lora_module_name(m))))
        refuse("lora.target_modules includes " + std::string(model::lora_module_name(m)) + ", which the server does not support");
  }
  if (caps.data_parallel_size > 1)
    refuse("the server runs data_parallel_size > 1: an adapter load would reach one rank only; run one replica per "
           "process behind `lorasync proxy`");
  if (caps.max_model_len > 0 && caps.max_model_len < cfg_.generation.context_len)
    refuse(fmt::format("the server's max_model_len is {} but generation.context_len is {}: restart it with "
                       "--max-model-len {} (or lower generation.context_len)", caps.max_model_len, cfg_.generation.context_len,
                       cfg_.generation.context_len));
  served_model_ = caps.served_name;
  if (!cfg_.model.served_name.empty() && served_model_ != cfg_.model.served_name)
    refuse("the server serves model '" + served_model_ + "' but model.served_name is '" + cfg_.model.served_name +
           "': point generation.server_url at the right server or fix model.served_name");
  if (caps.base_model_sha256 && *caps.base_model_sha256 != base_sha_)
    refuse("the server's base model (sha256 " + caps.base_model_sha256->substr(0, 12) +
           "...) is not the trainer's model.path (" + base_sha_.substr(0, 12) + "...): both must load the same weights");
  const bool can_push = caps.adapter_push && *caps.adapter_push == io::kBundleFormat;
  if (cfg_.sync.transport == "push" && !can_push)
    refuse("sync.transport = \"push\" but the server does not take pushed adapters (its /server_info has no adapter_push \"" +
           std::string(io::kBundleFormat) + "\"): use \"path\" or \"auto\"");
  push_ = cfg_.sync.transport == "push" || (cfg_.sync.transport == "auto" && can_push);
  LS_LOG_INFO("trainer", "weight sync by {}", push_ ? "push (the adapter's bytes over HTTP)" : "path (load_lora_adapter)");
  if (!caps.dtype.empty() && caps.dtype != model::dtype_name(model_->dtype()))
    LS_LOG_WARN("trainer", "the servers compute in {} but model.dtype is {}: expect ratio != 1", caps.dtype, model::dtype_name(model_->dtype()));
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

void Trainer::shutdown_pipeline() {
  if (pipe_) pipe_->stop();
}

int Trainer::run() {
  configure_process();
  tty_ = ::isatty(2) != 0;
  if (dist_env_) dist_ = DistGroup::connect(*dist_env_, DistOptions::from_environment());
  // The other ranks hear how the run ended: stop (with the exit code) or abort (with the error).
  try {
    resolve_config();
    dp_send_config();
    const int rc = run_main();
    if (rc == 0 || rc == 143) dp_finish("stop", std::to_string(rc));
    else dp_finish("abort", dp_error_.empty() ? "rank 0 stopped with exit code " + std::to_string(rc) : dp_error_);
    return rc;
  } catch (const std::exception& e) {
    dp_finish("abort", e.what());
    throw;
  }
}

int Trainer::run_main() {
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
    groups_log_.append(j.dump());  // under the pipeline's lock: memory only
  });
  pipe_->set_event_offset([this] { return groups_log_.logical_offset(); });

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
  dp_send_init();
  // Leftover versions of this prefix are unloaded (and, on a fresh run, deleted).
  unload_leftovers({});
  if (!args_.resume) {
    for (auto v : publisher_->existing_versions()) publisher_->remove_version(v);
  }
  metrics_.open(mfile);
  if (cfg_.logging.group_log) groups_log_.open(out_ / "groups.jsonl");
  if (cfg_.logging.group_log && !cfg_.env.command.empty()) episodes_log_.open(out_ / "episodes.jsonl");
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
      if (cfg_.async.ordered) wait_sync_idle();  // ordered: no step starts during a sync
    }
    pending_sync_version_.reset();
  }

  run_start_ = now_s();
  last_step_end_ = now_s();
  double sync_wait_carry = 0, ckpt_carry = 0;
  // A step that fails part way: before the optimizer moved, it never happened (its number is not
  // used, its groups go back to the front of the queue, so the checkpoint written on the way out
  // holds them); after, it is complete and recorded. Either way the checkpoint is consistent.
  std::vector<Group> step_groups;
  bool in_step = false;
  std::int64_t opt_steps_before = 0;
  auto settle_partial_step = [&] {
    if (!in_step) return;
    in_step = false;
    if (opt_->steps() == opt_steps_before) {
      LS_LOG_WARN("trainer", "step {} did not complete: its {} groups go back to the queue", step_, step_groups.size());
      --step_;
      --steps_this_run_;
      pipe_->unpop(std::move(step_groups));
    } else {
      pipe_->record_trained(step_groups);
    }
    step_groups.clear();
  };
  try {
    while (step_ < cfg_.max_steps) {
      event_step_ = step_ + 1;
      double wait_s = 0;
      step_groups = assemble_step(wait_s);
      if (step_groups.empty()) break;  // data exhausted
      std::vector<Group>& groups = step_groups;
      json m;
      opt_steps_before = opt_->steps();
      in_step = true;
      ++step_;
      ++steps_this_run_;
      train_step(groups, m);
      in_step = false;
      pipe_->record_trained(groups);
      log_episodes(groups);
      double sync_wait = sync_wait_carry;
      sync_wait_carry = 0;
      if (step_ % cfg_.sync.weight_sync_steps == 0) {
        sync_wait += wait_sync_idle();  // at most one sync at a time
        start_sync(step_);
        // async.ordered: the next step's groups are dispatched after the switch, never during it
        if (cfg_.sync.blocking || cfg_.async.ordered) sync_wait += wait_sync_idle();
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
          // No info: either retired (unloaded, older than the current version) or a sync's
          // snapshot not announced yet (newer): only the former goes.
          const bool beyond = info ? cur && cur->sync_index - info->sync_index > cfg_.async.max_staleness
                                   : cur && it->first < cur->version;
          const bool old = beyond && !loaded.count(it->first);
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
      groups_log_.flush();
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
    // A fatal error raised after the last step's groups were assembled (a refused request of the
    // next step's rollouts) did not stop the run, but it is still a failure (trainer.md §1: exit 1
    // with the error): the final checkpoint and adapter are written and consistent, and the
    // checkpoint owes the refused prompt.
    const std::optional<std::string> late = pipe_->fatal();
    json fin = {{"event", "finished"}, {"step", step_}, {"final_adapter", (out_ / "final_adapter").string()}};
    if (late) fin["error"] = *late;
    std::printf("%s\n", fin.dump().c_str());
    std::fflush(stdout);
    if (late) {
      LS_LOG_ERROR("trainer", "{}", *late);
      std::fprintf(stderr, "lorasync train: error after the last step (final checkpoint and adapter written): %s\n", late->c_str());
      return 1;
    }
    return 0;
  } catch (const Preempted&) {
    if (tty_) std::fprintf(stderr, "\n");
    settle_partial_step();
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
    dp_error_ = e.what();
    try {
      settle_partial_step();
    } catch (const std::exception& e2) {
      LS_LOG_ERROR("trainer", "putting the failed step's groups back failed: {}", e2.what());
    }
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

}  // namespace detail

using detail::ConfigRefusal;
using detail::Trainer;

int run_trainer(const TrainArgs& args) {
  try {
    auto dist = DistEnv::from_environment();
    if (dist && dist->rank != 0) return detail::run_dp_worker(args, *dist);
    Trainer t(args, dist);
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
