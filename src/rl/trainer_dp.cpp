// rl/trainer_dp.cpp: rank 0's side of the data-parallel protocol (docs/trainer.md "Data-parallel ranks"). Rank 0 owns the
// rollout pipeline, the queue, publishing and checkpoints; it numbers its messages to the other
// ranks msg/0 (configuration), msg/1 (adapter and optimizer state), msg/2... (steps), then stop
// or abort, and erases each once every rank has read it (known when the step's all-reduce
// completes). The other ranks' side is rl/dp_worker.cpp.
#include "rl/trainer_impl.h"

namespace lorasync::rl::detail {

void Trainer::dp_send_config() {
  if (!dist_) return;
  const int world = dist_->world();
  if (cfg_.batching.samples_per_step < world)
    refuse(fmt::format("batching.samples_per_step = {} is smaller than the {} data-parallel ranks: every rank needs at least "
                       "one sample per step (raise batching.samples_per_step to {} or more, or run fewer ranks)",
                       cfg_.batching.samples_per_step, world, world));
  if (cfg_.batching.samples_per_step < 2 * world)
    LS_LOG_WARN("trainer", "batching.samples_per_step = {} over {} ranks: {} sample(s) per rank per step leave the ranks "
                "badly balanced", cfg_.batching.samples_per_step, world, cfg_.batching.samples_per_step / world);
  dp_post(encode_config(cfg_.to_toml()));
}

void Trainer::dp_send_init() {
  if (!dist_) return;
  InitState s;
  s.lora_config_json = adapter_.config().to_peft_json();
  s.params = adapter_.parameters();
  s.exp_avg = opt_->exp_avg();
  s.exp_avg_sq = opt_->exp_avg_sq();
  s.optimizer_steps = opt_->steps();
  dp_post(encode_init(s));
}

void Trainer::dp_send_step(StepWork& w) {
  // Snapshots for the recompute pass: sent once, kept by the ranks while steps need them.
  std::set<std::int64_t> need;
  if (loss_cfg_.old_policy == OldPolicy::kRecompute)
    for (const auto& s : w.samples) need.insert(s.version);
  for (auto v : need) {
    if (dp_versions_.count(v)) continue;
    auto it = version_adapters_.find(v);
    if (it == version_adapters_.end())
      throw Error(ErrorKind::kInternal, fmt::format("no snapshot of version {} for the other ranks' recompute pass", v));
    w.versions[v] = it->second.parameters();
  }
  w.keep_versions.assign(need.begin(), need.end());
  dp_versions_ = need;
  // Every earlier message has been read by every rank: the last step's all-reduce completed.
  if (dp_seq_ > 2) dist_->erase("msg/" + std::to_string(dp_seq_ - 1));
  if (dp_seq_ == 3) dist_->erase("msg/0"), dist_->erase("msg/1");
  dp_post(encode_step_work(w));
}

void Trainer::dp_post(const std::string& bytes) {
  dist_->set("msg/" + std::to_string(dp_seq_), bytes);
  ++dp_seq_;  // only once it is there: a failed post is retried under the same number (abort)
}

std::string Trainer::dp_failure(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) {
    std::string why = "no error recorded";
    if (r == 0) continue;
    try {
      const double until = now_s() + 10;
      if (auto e = dist_->get_wait("err/" + std::to_string(r), r, [&] { return now_s() > until; })) why = *e;
      dist_->erase("err/" + std::to_string(r));
    } catch (const std::exception& e) {
      why = e.what();
    }
    out += fmt::format("{}data-parallel rank {} failed in step {}: {}", out.empty() ? "" : "; ", r, step_, why);
  }
  return out;
}

void Trainer::dp_check_peers() {
  if (!dist_ || now_s() - dp_last_check_ < 1.0) return;
  dp_last_check_ = now_s();
  const auto silent = dist_->silent_ranks();
  if (silent.empty()) return;
  throw Error(ErrorKind::kUnavailable, fmt::format("data-parallel rank {} stopped answering (no heartbeat for {:.0f} s); the "
                                                   "checkpoint written now resumes with any number of ranks",
                                                   silent.front(), DistOptions::from_environment().silent_after_s));
}

void Trainer::dp_finish(const std::string& kind, const std::string& message) noexcept {
  if (!dist_) return;
  try {
    StepWork w;
    w.kind = kind;
    w.message = message;
    dp_post(encode_step_work(w));
    // Rank 0 hosts the store (unless the launcher does): wait until every rank has read the
    // message, for as long as it still has a heartbeat (a rank may be loading a large model).
    const double deadline = now_s() + DistOptions::from_environment().timeout_s;
    for (int r = 1; r < dist_->world(); ++r) {
      auto gone = [&] {
        if (now_s() > deadline) return true;
        const auto s = dist_->silent_ranks();
        return std::find(s.begin(), s.end(), r) != s.end();
      };
      if (!dist_->get_wait("bye/" + std::to_string(r), -1, gone))
        LS_LOG_WARN("trainer", "rank {} did not confirm the end of the run", r);
    }
  } catch (const std::exception& e) {
    LS_LOG_WARN("trainer", "could not tell the other ranks to {}: {}", kind, e.what());
  }
}

}  // namespace lorasync::rl::detail
