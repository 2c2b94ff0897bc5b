// rl/grpo_loss.h: the per-token GRPO objective with truncated importance sampling
// (trainer.md §2.2-2.4).
//
//   r_t   = exp(lp_theta - lp_mu)                      reported as `ratio`
//   rho_t = exp(lp_theta - lp_old)                     PPO ratio (trust region)
//   w_t   = sg(min(exp(lp_old - lp_mu), C)), or 1 when C = 0   (TIS weight, engine mismatch)
//   L_t   = -w_t * min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A) + beta * k3_t
//   k3_t  = exp(lp_ref - lp_theta) - (lp_ref - lp_theta) - 1   (KL to the base model)
// lp_old per old_policy: recompute = the trainer's logprobs under the sample's version (given);
// step_start = sg(lp_theta); behaviour = lp_mu (requires C = 0).
// The caller aggregates: token_mean divides the step's sum by its completion tokens,
// seq_sum_const by n_samples * K; rows contribute partial sums over the global denominator.
// Shapes: every input is a 1-D tensor over the same completion tokens; fp32 or fp64.
// Thread-safety: pure functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lorasync::rl {

enum class OldPolicy { kRecompute, kStepStart, kBehaviour };
OldPolicy parse_old_policy(const std::string& name);

enum class LossAgg { kTokenMean, kSeqSumConst };
LossAgg parse_loss_agg(const std::string& name);

struct LossConfig {
  double eps_low = 0.2;
  double eps_high = 0.2;
  double tis_cap = 2.0;   // C; 0 = no TIS
  double beta = 0.0;      // KL coefficient
  OldPolicy old_policy = OldPolicy::kRecompute;
};

struct TokenInputs {
  at::Tensor logp;        // lp_theta, with gradient
  at::Tensor behaviour;   // lp_mu from the server
  at::Tensor old;         // lp_old (recompute mode only)
  at::Tensor advantages;  // A of each token's sample
  at::Tensor ref;         // lp_ref (beta > 0 only)
};

// Sums and extremes over tokens, mergeable across rows; means are taken at the end.
struct LossStats {
  std::int64_t n_tokens = 0;
  double ratio_sum = 0, ratio_min = 1e300, ratio_max = -1e300;
  double clip_low = 0, clip_high = 0;          // token counts
  double tis_weight_sum = 0, tis_clipped = 0;  // sum of w, count of exp(lp_old - lp_mu) > C
  double kl_sum = 0;                           // k3 to the reference (beta > 0)
  double mismatch_k3_sum = 0, mismatch_k1_sum = 0;
  double prob_diff_max = -1e300, prob_diff_min = 1e300;
  void merge(const LossStats& o);
  // n_tokens then the kLossStatValues sums and extremes, as doubles (sent between ranks).
  static constexpr std::size_t kNumValues = 13;
  void to_values(std::vector<double>& out) const;
  static LossStats from_values(const double* v);  // kNumValues values
};

// Per-token losses L_t (differentiable through inputs.logp); fills `stats` when given.
at::Tensor grpo_token_losses(const TokenInputs& in, const LossConfig& cfg, LossStats* stats = nullptr);

// The same, with the statistics left on the device as fp64 [kLossStatValues] (undefined for no
// tokens), so a step reads every row's back at once instead of synchronising per row.
constexpr std::int64_t kLossStatValues = 12;
at::Tensor grpo_token_losses_with_stats(const TokenInputs& in, const LossConfig& cfg, at::Tensor* stats_values);
LossStats loss_stats_from_values(const at::Tensor& values, std::int64_t n_tokens);

}  // namespace lorasync::rl
