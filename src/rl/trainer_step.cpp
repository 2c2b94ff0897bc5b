// rl/trainer_step.cpp: step assembly with the staleness re-check, the GRPO step (packing, recompute/KL passes,
// loss, backward, clipping, AdamW, fp16 scaling), its metrics and the console line (trainer.md §2-3, §6).
#include "rl/trainer_impl.h"

#include <ATen/core/grad_mode.h>

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
  // Per-row figures stay on the device until the step's end: one host read per step, not per row.
  std::vector<at::Tensor> row_stats, row_loss, row_entropy;
  std::vector<std::int64_t> row_tokens;
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
    auto out = packed_row_logprobs(*model_, &adapter_, sub, temp, cfg.batching.logits_chunk,
                                   cfg.batching.activation_checkpointing);
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
    at::Tensor values;
    at::Tensor L = grpo_token_losses_with_stats(in, loss_cfg_, &values);
    if (values.defined()) row_stats.push_back(values), row_tokens.push_back(in.logp.numel());
    at::Tensor loss = L.sum() / denom;
    row_loss.push_back(loss.detach().to(torch::kDouble));
    if (out.entropy.defined()) row_entropy.push_back(out.entropy.sum().to(torch::kDouble));
    (loss * loss_scale_).backward();
  }
  LossStats stats;
  double J = 0, ent_sum = 0;
  if (!row_stats.empty()) {
    auto all = torch::stack(row_stats).to(torch::kCPU);
    for (std::size_t i = 0; i < row_stats.size(); ++i) stats.merge(loss_stats_from_values(all[static_cast<std::int64_t>(i)], row_tokens[i]));
  }
  if (!row_loss.empty()) J = torch::stack(row_loss).sum().item<double>();
  if (!row_entropy.empty()) ent_sum = torch::stack(row_entropy).sum().item<double>();
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
  double scored = 0;  // members with a reward (a failed external reward leaves NaN: excluded)
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
      if (mem.finish == "length") clipped += 1;
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
  m["learning_rate"] = lr_at(std::max<std::int64_t>(0, opt_->steps() - 1));
  if (fp16) m["loss_scale"] = loss_scale_;
  m["reward"] = rsum / std::max(1.0, scored);
  for (std::size_t k = 0; k < reward_names_.size(); ++k) m["rewards/" + reward_names_[k]] = part_sums[k] / std::max(1.0, scored);
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

}  // namespace lorasync::rl::detail
