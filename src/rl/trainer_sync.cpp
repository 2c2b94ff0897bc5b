// rl/trainer_sync.cpp: the sync thread (trainer.md §4): publish, load, switch, unload drained versions, retention.
#include "rl/trainer_impl.h"

namespace lorasync::rl::detail {

// How long the sync waits for the cancelled requests of a version leaving the window to end.
constexpr double kUnloadDrainWait = 10;

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

void Trainer::push_adapter(const Published& p) {
  const fs::path server_dir = cfg_.sync.server_publish_dir.empty() ? p.dir : fs::path(cfg_.sync.server_publish_dir) / p.name;
  const std::string body = push_bundle(p, server_dir.string());
  const double deadline = now_s() + cfg_.sync.adapter_load_deadline;
  auto& c = sync_client_ ? *sync_client_ : *client_;
  if (cfg_.sync.pause_during_load) c.request("POST", "/pause?mode=keep", "{}", 60, true);
  for (;;) {
    auto r = c.request("POST", std::string(io::kPushPath), body, cfg_.sync.adapter_load_deadline + 30, true,
                       "application/octet-stream");
    if (r.status == 200) break;
    const std::string msg = r.status ? http::error_message_of(r.body) : r.message;
    const bool transient = r.status == 0 || r.status == 429 || r.status >= 500;
    if (!transient || now_s() > deadline) {
      if (cfg_.sync.pause_during_load) c.request("POST", "/resume", "{}", 60, true);
      throw Error(ErrorKind::kUnavailable, "pushing adapter " + p.name + " failed (" +
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
  Published p = publisher_->publish(job.snapshot, job.version, job.step, push_);
  d.save_s = p.save_s;
  d.publish_s = p.publish_s;
  VersionInfo vi{job.version, job.sync_index, p.name, p.adapter_sha256};
  pipe_->add_version(vi);
  // A version left over from the previous sync (its cancelled requests had not ended then) goes
  // before the load: with --max-loras = max_staleness + 2 its slot is the one the load needs.
  retire_versions(job.version, job.sync_index - 1, 0);
  const double l0 = now_s();
  if (push_) push_adapter(p);
  else load_adapter(p.name, p.dir);
  d.load_s = now_s() - l0;
  {
    std::lock_guard lk(sync_mu_);
    loaded_.insert(job.version);
  }
  pipe_->switch_to(job.version);
  // Retention: delete the directories unloaded at the previous sync, then unload the versions that
  // left the window (the switch has just cancelled their requests; their directories go at the
  // next sync).
  std::vector<std::int64_t> deleting;
  {
    std::lock_guard lk(sync_mu_);
    deleting.swap(to_delete_);
  }
  for (auto v : deleting) publisher_->remove_version(v);
  retire_versions(job.version, job.sync_index, kUnloadDrainWait);
  d.total_s = now_s() - t0;
  std::lock_guard lk(sync_mu_);
  sync_done_.push_back(d);
}

void Trainer::retire_versions(std::int64_t keep, std::int64_t sync_index, double drain_wait_s) {
  std::set<std::int64_t> loaded;
  {
    std::lock_guard lk(sync_mu_);
    loaded = loaded_;
  }
  const double deadline = now_s() + drain_wait_s;
  for (auto v : loaded) {
    if (v == keep) continue;
    auto info = pipe_->version(v);
    const std::int64_t k = info ? info->sync_index : 0;
    if (sync_index - k <= cfg_.async.max_staleness) continue;
    while (pipe_->in_flight_uses(v) && now_s() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (pipe_->in_flight_uses(v)) continue;  // tried again before the next load
    if (unload_adapter(publisher_->name_of(v))) {
      pipe_->retire_version(v);
      std::lock_guard lk(sync_mu_);
      loaded_.erase(v);
      to_delete_.push_back(v);
    }
  }
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

}  // namespace lorasync::rl::detail
