#include "rl/grpo_loss.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "util/error.h"

namespace lorasync::rl {

OldPolicy parse_old_policy(const std::string& name) {
  if (name == "recompute") return OldPolicy::kRecompute;
  if (name == "step_start") return OldPolicy::kStepStart;
  if (name == "behaviour") return OldPolicy::kBehaviour;
  throw_invalid("grpo.old_policy must be \"recompute\", \"step_start\" or \"behaviour\", got \"{}\"", name);
}

LossAgg parse_loss_agg(const std::string& name) {
  if (name == "token_mean") return LossAgg::kTokenMean;
  if (name == "seq_sum_const") return LossAgg::kSeqSumConst;
  throw_invalid("grpo.loss_agg must be \"token_mean\" or \"seq_sum_const\", got \"{}\"", name);
}

namespace {

// The order of grpo_token_losses_with_stats' values (and of to_values / from_values after n_tokens).
constexpr double LossStats::*kFields[kLossStatValues] = {
    &LossStats::ratio_sum,      &LossStats::ratio_min,       &LossStats::ratio_max,
    &LossStats::clip_low,       &LossStats::clip_high,       &LossStats::tis_weight_sum,
    &LossStats::tis_clipped,    &LossStats::kl_sum,          &LossStats::mismatch_k3_sum,
    &LossStats::mismatch_k1_sum, &LossStats::prob_diff_max,  &LossStats::prob_diff_min};
static_assert(LossStats::kNumValues == 1 + kLossStatValues);

}  // namespace

void LossStats::to_values(std::vector<double>& out) const {
  out.push_back(static_cast<double>(n_tokens));
  for (auto f : kFields) out.push_back(this->*f);
}

LossStats LossStats::from_values(const double* v) {
  LossStats s;
  s.n_tokens = static_cast<std::int64_t>(v[0]);
  for (std::int64_t i = 0; i < kLossStatValues; ++i) s.*kFields[i] = v[i + 1];
  return s;
}

void LossStats::merge(const LossStats& o) {
  n_tokens += o.n_tokens;
  ratio_sum += o.ratio_sum;
  ratio_min = std::min(ratio_min, o.ratio_min);
  ratio_max = std::max(ratio_max, o.ratio_max);
  clip_low += o.clip_low;
  clip_high += o.clip_high;
  tis_weight_sum += o.tis_weight_sum;
  tis_clipped += o.tis_clipped;
  kl_sum += o.kl_sum;
  mismatch_k3_sum += o.mismatch_k3_sum;
  mismatch_k1_sum += o.mismatch_k1_sum;
  prob_diff_max = std::max(prob_diff_max, o.prob_diff_max);
  prob_diff_min = std::min(prob_diff_min, o.prob_diff_min);
}

at::Tensor grpo_token_losses(const TokenInputs& in, const LossConfig& cfg, LossStats* stats) {
  at::Tensor values;
  auto loss = grpo_token_losses_with_stats(in, cfg, stats != nullptr ? &values : nullptr);
  if (stats != nullptr && values.defined()) stats->merge(loss_stats_from_values(values, in.logp.numel()));
  return loss;
}

LossStats loss_stats_from_values(const at::Tensor& values, std::int64_t n_tokens) {
  auto v = values.to(at::kCPU).to(at::kDouble).contiguous();
  if (v.numel() != kLossStatValues) throw_invalid("loss statistics hold {} values, expected {}", v.numel(), kLossStatValues);
  const double* d = v.data_ptr<double>();
  LossStats s;
  s.n_tokens = n_tokens;
  for (std::int64_t i = 0; i < kLossStatValues; ++i) s.*kFields[i] = d[i];
  return s;
}

at::Tensor grpo_token_losses_with_stats(const TokenInputs& in, const LossConfig& cfg, at::Tensor* stats_values) {
  const auto& lp = in.logp;
  const auto mu = in.behaviour.to(lp.scalar_type());
  const auto adv = in.advantages.to(lp.scalar_type());
  if (cfg.old_policy == OldPolicy::kBehaviour && cfg.tis_cap > 0)
    throw_invalid("grpo.old_policy = \"behaviour\" requires grpo.tis_cap = 0 (got {})", cfg.tis_cap);
  at::Tensor old;
  switch (cfg.old_policy) {
    case OldPolicy::kRecompute:
      if (!in.old.defined()) throw_invalid("old_policy recompute needs the old-policy logprobs");
      old = in.old.to(lp.scalar_type()).detach();
      break;
    case OldPolicy::kStepStart: old = lp.detach(); break;
    case OldPolicy::kBehaviour: old = mu; break;
  }
  auto rho = at::exp(lp - old);
  auto surr = at::minimum(rho * adv, at::clamp(rho, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv);
  at::Tensor w;
  at::Tensor iw = at::exp(old - mu);
  if (cfg.tis_cap > 0) w = at::clamp_max(iw, cfg.tis_cap).detach();
  else w = at::ones_like(lp);
  auto loss = -w * surr;
  at::Tensor k3;
  if (cfg.beta > 0) {
    if (!in.ref.defined()) throw_invalid("grpo.beta > 0 needs the reference logprobs");
    auto d = in.ref.to(lp.scalar_type()).detach() - lp;
    k3 = at::exp(d) - d - 1;
    loss = loss + cfg.beta * k3;
  }
  if (stats_values != nullptr) {
    *stats_values = at::Tensor();
    if (lp.numel() > 0) {
      at::NoGradGuard ng;
      auto lpd = lp.detach().to(at::kDouble);
      auto mud = mu.to(at::kDouble);
      auto r = at::exp(lpd - mud);
      auto rhod = rho.detach().to(at::kDouble);
      auto advd = adv.to(at::kDouble);
      auto x = cfg.old_policy == OldPolicy::kRecompute ? old.to(at::kDouble) : lpd;
      auto dx = x - mud;
      auto pd = at::exp(x) - at::exp(mud);
      auto zero = at::zeros({}, lpd.options());
      // Order: LossStats' fields after n_tokens (loss_stats_from_values).
      *stats_values = at::stack({r.sum(), r.min(), r.max(),
                                 ((rhod < 1.0 - cfg.eps_low) & (advd < 0)).sum().to(at::kDouble),
                                 ((rhod > 1.0 + cfg.eps_high) & (advd > 0)).sum().to(at::kDouble),
                                 w.to(at::kDouble).sum(),
                                 cfg.tis_cap > 0 ? (iw.to(at::kDouble) > cfg.tis_cap).sum().to(at::kDouble) : zero,
                                 k3.defined() ? k3.detach().to(at::kDouble).sum() : zero,
                                 (at::exp(dx) - dx - 1).sum(), (-dx).sum(), pd.max(), pd.min()});
    }
  }
  return loss;
}

}  // namespace lorasync::rl
