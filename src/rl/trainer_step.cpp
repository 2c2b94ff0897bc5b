// rl/trainer_step.cpp: step assembly with the staleness re-check, the GRPO step (packing, recompute/KL passes,
// loss, backward, clipping, AdamW, fp16 scaling), its metrics and the console line (trainer.md §2-3, §6).
#include "rl/trainer_impl.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "rl/advantages.h"

namespace lorasync::rl::detail {

namespace {

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto t = static_cast<std::int64_t>(s);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

}  // namespace

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
  pipe_->grant(cfg_.batching.samples_per_step);  // async.ordered: this step's groups, and no more
  for (;;) {
    while (samples < cfg_.batching.samples_per_step) {
      if (g_stop_signal.load()) throw Preempted{};
      dp_check_peers();
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
        it->staleness = s;
        ++it;
      }
    }
    if (!dropped || pipe_->exhausted()) break;
  }
  wait_s = now_s() - t0;
  return std::move(groups);
}

void Trainer::log_episodes(const std::vector<Group>& groups) {
  if (cfg_.env.command.empty() || !cfg_.logging.group_log) return;
  for (const auto& g : groups) {
    std::int64_t mi = 0;
    for (const auto& mem : g.members) {
      // The model's turns: the runs of masked-in tokens, decoded (a trailing stop token left out).
      json turns = json::array();
      for (std::size_t i = 0; i < mem.ids.size();) {
        if (!mem.trainable(i)) {
          ++i;
          continue;
        }
        std::size_t e = i;
        while (e < mem.ids.size() && mem.trainable(e)) ++e;
        std::vector<std::int32_t> t(mem.ids.begin() + static_cast<std::ptrdiff_t>(i), mem.ids.begin() + static_cast<std::ptrdiff_t>(e));
        if (!t.empty() && std::find(stop_ids_.begin(), stop_ids_.end(), t.back()) != stop_ids_.end()) t.pop_back();
        turns.push_back(tokenizer_->decode(t));
        i = e;
      }
      json j = {{"step", step_}, {"prompt", g.prompt.index}, {"epoch", g.prompt.epoch}, {"attempt", g.prompt.attempt},
                {"member", mi++}, {"version", g.version}, {"turns", mem.turns}, {"finish", mem.finish},
                {"reward", mem.valid() ? json(mem.reward) : json(nullptr)}, {"advantage", mem.advantage},
                {"model_tokens", mem.model_tokens()}, {"env_tokens", static_cast<std::int64_t>(mem.ids.size()) - mem.model_tokens()},
                {"text", turns}};
      episodes_log_.write(j.dump(-1, ' ', false, json::error_handler_t::replace));
    }
  }
}

void Trainer::train_step(std::vector<Group>& groups, json& m) {
  const auto& cfg = cfg_;
  StepWork w;
  w.temperature = cfg.generation.temperature;
  std::int64_t total_completion = 0, total_tokens = 0, gi = 0;
  for (const auto& g : groups) {
    const Problem* pr = find_problem(data_, g.prompt.index);
    LS_CHECK(pr, "group for an unknown prompt");
    std::int64_t mi = 0;
    for (const auto& mem : g.members) {
      // An episode that failed before its first model turn has nothing to train.
      if (mem.ids.empty() || mem.model_tokens() == 0) {
        ++mi;
        continue;
      }
      StepSample s;
      s.prompt = mem.prompt_ids.empty() ? pr->prompt_ids : mem.prompt_ids;
      s.completion.assign(mem.ids.begin(), mem.ids.end());
      s.behaviour = mem.logprobs;
      s.mask = mem.mask;
      s.versions = mem.versions;
      s.advantage = static_cast<float>(mem.advantage);
      s.version = g.version;
      s.group = gi, s.member = mi++;
      total_completion += s.trained_tokens();
      total_tokens += static_cast<std::int64_t>(s.prompt.size() + s.completion.size());
      w.samples.push_back(std::move(s));
    }
    ++gi;
  }
  const auto n = static_cast<std::int64_t>(w.samples.size());
  const double K = static_cast<double>(cfg.grpo.loss_norm_const > 0 ? cfg.grpo.loss_norm_const : cfg.generation.max_new_tokens);
  w.denom = agg_ == LossAgg::kTokenMean ? static_cast<double>(std::max<std::int64_t>(1, total_completion)) : static_cast<double>(n) * K;
  w.lr = lr_at(opt_->steps());
  w.loss_scale = loss_scale_;
  const int world = dist_ ? dist_->world() : 1;
  w.owner = assign_ranks(w.samples, world, model_->config());
  w.step = step_;
  if (dist_) dp_send_step(w);
  // This rank's share (all of it with one rank), then the gradients summed across ranks; a share
  // that fails still joins the collectives, so every rank leaves the step together.
  StepContext ctx{*model_, adapter_, version_adapters_, loss_cfg_, cfg.batching, device_};
  ShareResult share;
  std::exception_ptr failure;
  try {
    maybe_inject_fault(0, step_);
    share = compute_share(ctx, w, samples_of(w.owner, 0));
  } catch (...) {
    if (!dist_) throw;
    failure = std::current_exception();
  }
  auto params = adapter_.parameters();
  double dp_imbalance = 1.0;
  const double c0 = now_s();
  if (dist_) {
    Reduced red = reduce_step(*dist_, params, share, failure != nullptr);
    if (failure) std::rethrow_exception(failure);
    if (!red.failed.empty()) throw Error(ErrorKind::kInternal, dp_failure(red.failed));
    share = std::move(red.merged);
    dp_imbalance = red.imbalance;
  }
  const double comm_s = now_s() - c0;
  const LossStats& stats = share.stats;
  const double J = share.loss, ent_sum = share.entropy_sum, fwd_s = share.fwd_s, recompute_s = share.recompute_s;
  const double fwd_bwd_s = share.fwd_bwd_s;
  // Optimizer: unscale (fp16), clip, AdamW; every rank takes the same step.
  const double o0 = now_s();
  const GradStep grad = apply_gradients(*opt_, params, loss_scale_, cfg.optimizer.max_grad_norm, w.lr);
  const double gnorm = grad.grad_norm;
  const bool fp16 = model_->dtype() == torch::kFloat16;
  if (!grad.finite && fp16) {
    loss_scale_ = std::max(1.0, loss_scale_ / 2);
    clean_steps_ = 0;
    pipe_->add_counter("skipped_steps_total", 1);
  } else if (!grad.finite) {
    throw Error(ErrorKind::kInternal, fmt::format("non-finite gradient norm at step {} (loss {})", step_ + 1, J));
  } else if (fp16 && ++clean_steps_ >= cfg.optimizer.loss_scale_window) {
    loss_scale_ *= 2, clean_steps_ = 0;
  }
  const double optimizer_s = now_s() - o0;
  // The rows every rank packed (the same plans they computed).
  PackPlan plan;
  double imbalance = 0;
  std::int64_t packed = 0;
  for (int r = 0; r < world; ++r) {
    PackPlan p = plan_share(w.samples, samples_of(w.owner, r), cfg.batching.row_tokens);
    for (auto t : p.row_tokens) packed += t;
    imbalance = std::max(imbalance, p.imbalance);
    for (auto& row : p.rows) plan.rows.push_back(std::move(row));
  }
  plan.fill = plan.rows.empty() ? 0 : static_cast<double>(packed) / static_cast<double>(plan.rows.size() * static_cast<std::size_t>(cfg.batching.row_tokens));
  plan.imbalance = imbalance;

  // Metrics of the step's samples.
  double rsum = 0, rstd_sum = 0, zero_std = 0, clipped = 0;
  std::int64_t minlen = std::numeric_limits<std::int64_t>::max(), maxlen = 0;
  std::vector<double> part_sums(reward_names_.size(), 0.0);
  double stale_sum = 0, stale_max = 0, tq = 0;
  const double tnow = now_s();
  double scored = 0;  // members with a reward (a failed external reward leaves NaN: excluded)
  double ep_n = 0, ep_turns = 0, ep_model = 0, ep_env = 0, ep_trunc = 0, ep_failed = 0;  // episodes
  std::vector<double> rewards;
  for (const auto& g : groups) {
    rewards.clear();
    for (const auto& mem : g.members) rewards.push_back(mem.reward);
    const double gs = reward_stats(rewards).std;
    rstd_sum += gs;
    if (gs == 0) zero_std += 1;
    const auto s = static_cast<double>(g.staleness);  // as checked before the step, never max + 1
    for (const auto& mem : g.members) {
      if (!std::isnan(mem.reward)) rsum += mem.reward, scored += 1;
      if (mem.finish == "length" || mem.finish == "truncated_length") clipped += 1;
      if (mem.turns > 0) {
        ep_n += 1, ep_turns += static_cast<double>(mem.turns);
        ep_model += static_cast<double>(mem.model_tokens());
        ep_env += static_cast<double>(static_cast<std::int64_t>(mem.ids.size()) - mem.model_tokens());
        if (mem.finish.rfind("truncated_", 0) == 0) ep_trunc += 1;
        if (mem.finish.rfind("env_", 0) == 0) ep_failed += 1;
      }
      minlen = std::min<std::int64_t>(minlen, static_cast<std::int64_t>(mem.ids.size()));
      maxlen = std::max<std::int64_t>(maxlen, static_cast<std::int64_t>(mem.ids.size()));
      for (std::size_t k = 0; !std::isnan(mem.reward) && k < part_sums.size() && k < mem.parts.size(); ++k)
        part_sums[k] += mem.parts[k];
      stale_sum += s;
      stale_max = std::max(stale_max, s);
      tq += tnow - g.enqueued_at;
    }
  }
  const double dn = static_cast<double>(std::max<std::int64_t>(1, n));
  const double nt = static_cast<double>(std::max<std::int64_t>(1, stats.n_tokens));
  m["loss"] = J;
  m["grad_norm"] = gnorm;
  m["learning_rate"] = w.lr;
  if (fp16) m["loss_scale"] = loss_scale_;
  m["reward"] = rsum / std::max(1.0, scored);
  for (std::size_t k = 0; k < reward_names_.size(); ++k) m["rewards/" + reward_names_[k]] = part_sums[k] / std::max(1.0, scored);
  m["reward_std"] = rstd_sum / static_cast<double>(groups.size());
  m["frac_reward_zero_std"] = zero_std / static_cast<double>(groups.size());
  m["completions/mean_length"] = static_cast<double>(total_completion) / dn;
  m["completions/min_length"] = minlen;
  m["completions/max_length"] = maxlen;
  m["completions/clipped_ratio"] = clipped / dn;
  if (ep_n > 0) {  // episodes (docs/environments.md): per step, over the step's episodes
    m["episode/turns_mean"] = ep_turns / ep_n;
    m["episode/model_tokens_per_turn"] = ep_model / std::max(1.0, ep_turns);
    m["episode/env_tokens_mean"] = ep_env / ep_n;
    m["episode/truncated_frac"] = ep_trunc / ep_n;
    m["episode/failed_frac"] = ep_failed / ep_n;
  }
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
  if (dist_) {
    m["dp/ranks"] = world;
    m["dp/compute_imbalance"] = dp_imbalance;  // slowest rank's forward/backward over the mean
    m["perf/dp_reduce_s"] = comm_s;
  }
  m["sample/staleness_mean"] = stale_sum / dn;
  m["sample/staleness_max"] = stale_max;
  m["sample/time_in_queue_s"] = tq / dn;
  // MFU (trainer.md §6): F = sum_i (4 P L_i + 6 n_layers d_attn L_i^2) + 4 d V C, per device with
  // data-parallel ranks; omitted on CPU.
  if (!device_.is_cpu() && cfg.logging.peak_tflops > 0) {
    double F = 0;
    for (const auto& smp : w.samples) F += sample_flops(smp, model_->config());
    F /= world;  // per device: each rank computed its share in the slowest rank's time
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

}  // namespace lorasync::rl::detail
