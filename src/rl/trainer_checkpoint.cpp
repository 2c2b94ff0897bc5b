// rl/trainer_checkpoint.cpp: writing the trainer checkpoint and restoring a run from one (trainer.md §5).
#include "rl/trainer_impl.h"

namespace lorasync::rl::detail {

namespace {

// Cuts `path` to `offset`; the tail moves to <path>.orphaned-<restart>.
void truncate_with_orphans(const fs::path& path, std::uint64_t offset, std::int64_t restart) {
  if (!fs::exists(path)) return;
  const auto size = fs::file_size(path);
  if (size <= offset) return;
  std::string all = read_file(path);
  write_file_atomic(path.string() + ".orphaned-" + std::to_string(restart), all.substr(offset));
  fs::resize_file(path, offset);
}

}  // namespace

void Trainer::write_checkpoint_now(bool final_ckpt) {
  const double t0 = now_s();
  // The groups log offset is taken inside the capture (the same critical section as the queue
  // and the cursor), then the log is flushed so the file holds at least that much.
  PipelineState ps = pipe_->capture();
  groups_log_.flush();
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
             {"episodes_offset", episodes_log_.offset()},
             {"groups_offset", ps.events_offset},
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
  if (st.contains("episodes_offset") && fs::exists(out_ / "episodes.jsonl"))
    truncate_with_orphans(out_ / "episodes.jsonl", st.at("episodes_offset").get<std::uint64_t>(), restarts_);
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

}  // namespace lorasync::rl::detail
