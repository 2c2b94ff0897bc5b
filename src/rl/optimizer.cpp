#include "rl/optimizer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

#include "util/error.h"

namespace lorasync::rl {

AdamW::AdamW(std::vector<at::Tensor> params, AdamWConfig cfg) : params_(std::move(params)), cfg_(cfg) {
  for (const auto& p : params_) {
    m_.push_back(at::zeros_like(p, at::TensorOptions().dtype(at::kFloat)));
    v_.push_back(at::zeros_like(p, at::TensorOptions().dtype(at::kFloat)));
  }
}

void AdamW::zero_grad() {
  for (auto& p : params_)
    if (p.grad().defined()) p.mutable_grad().zero_();
}

void AdamW::step(double lr) {
  // The same element-wise maths as a per-tensor loop, as multi-tensor (_foreach) operations: one
  // launch per operation for all of the adapter's tensors on CUDA (hundreds of small tensors), and
  // the same results bit for bit.
  at::NoGradGuard ng;
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, static_cast<double>(t_));
  std::vector<at::Tensor> p, g, m, v;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].grad().defined()) continue;
    p.push_back(params_[i]);
    g.push_back(params_[i].grad().to(at::kFloat));
    m.push_back(m_[i]);
    v.push_back(v_[i]);
  }
  if (p.empty()) return;
  at::_foreach_mul_(m, cfg_.beta1);
  at::_foreach_add_(m, g, 1.0 - cfg_.beta1);
  at::_foreach_mul_(v, cfg_.beta2);
  at::_foreach_addcmul_(v, g, g, 1.0 - cfg_.beta2);
  auto denom = at::_foreach_div(v, bc2);
  at::_foreach_sqrt_(denom);
  at::_foreach_add_(denom, cfg_.eps);
  if (cfg_.weight_decay != 0) at::_foreach_mul_(p, 1.0 - lr * cfg_.weight_decay);
  at::_foreach_addcdiv_(p, m, denom, -lr / bc1);
}

void AdamW::load_state(std::vector<at::Tensor> m, std::vector<at::Tensor> v, std::int64_t t) {
  if (m.size() != params_.size() || v.size() != params_.size())
    throw_invalid("optimizer state holds {} tensors, the adapter has {}", m.size(), params_.size());
  m_ = std::move(m);
  v_ = std::move(v);
  t_ = t;
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  at::NoGradGuard ng;
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0.0;
  // Per-tensor norms in fp64 in one multi-tensor call, then one host read for the global norm.
  auto norms = at::_foreach_norm(grads, 2, at::kDouble);
  const double norm = at::stack(norms).pow(2).sum().sqrt().item<double>();
  if (max_norm > 0 && norm > max_norm) at::_foreach_mul_(grads, max_norm / (norm + 1e-6));
  return norm;
}

}  // namespace lorasync::rl
