// rl/optimizer.h: AdamW over the LoRA tensors only, fp32 masters and states (trainer.md §2.5),
// and global gradient-norm clipping.
// Thread-safety: owned by the trainer thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace lorasync::rl {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.0;
};

class AdamW {
 public:
  AdamW(std::vector<at::Tensor> params, AdamWConfig cfg);
  // One update with learning rate lr; parameters without a gradient are skipped.
  void step(double lr);
  void zero_grad();
  std::int64_t steps() const { return t_; }
  const std::vector<at::Tensor>& exp_avg() const { return m_; }
  const std::vector<at::Tensor>& exp_avg_sq() const { return v_; }
  // Restores moments and the step count (checkpoint resume).
  void load_state(std::vector<at::Tensor> m, std::vector<at::Tensor> v, std::int64_t t);

 private:
  std::vector<at::Tensor> params_, m_, v_;
  AdamWConfig cfg_;
  std::int64_t t_ = 0;
};

// Scales gradients so their global L2 norm is at most max_norm; returns the norm before clipping.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace lorasync::rl
