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
  at::NoGradGuard ng;
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, static_cast<double>(t_));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    if (!p.grad().defined()) continue;
    auto g = p.grad().to(at::kFloat);
    m_[i].mul_(cfg_.beta1).add_(g, 1.0 - cfg_.beta1);
    v_[i].mul_(cfg_.beta2).addcmul_(g, g, 1.0 - cfg_.beta2);
    auto denom = (v_[i] / bc2).sqrt_().add_(cfg_.eps);
    if (cfg_.weight_decay != 0) p.mul_(1.0 - lr * cfg_.weight_decay);
    p.addcdiv_(m_[i], denom, -lr / bc1);
  }
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
  double sq = 0;
  for (const auto& p : params)
    if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  const double norm = std::sqrt(sq);
  if (max_norm > 0 && norm > max_norm) {
    const double s = max_norm / (norm + 1e-6);
    for (const auto& p : params)
      if (p.grad().defined()) const_cast<at::Tensor&>(p).mutable_grad().mul_(s);
  }
  return norm;
}

}  // namespace lorasync::rl
