#include "core/model/autograd_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <utility>

namespace lorasync::model {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a checkpointed body needs in the backward pass, carried in the context as a capsule.
struct Recompute : torch::CustomClassHolder {
  TensorFn body;
  std::vector<at::Tensor> params;  // the very tensors body reads (leaves: their gradients go there)
};

struct CheckpointFn : torch::autograd::Function<CheckpointFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& h, at::TensorList params,
                               c10::intrusive_ptr<Recompute> rc) {
    (void)params;  // inputs for the graph's edges; body reads them itself
    ctx->save_for_backward({h});
    at::Tensor y = rc->body(h);  // gradient mode is off here: nothing inside is kept
    ctx->saved_data["rc"] = c10::IValue::make_capsule(std::move(rc));
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const at::Tensor h = ctx->get_saved_variables()[0];
    auto rc = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["rc"].toCapsule());
    at::Tensor hd = h.detach().requires_grad_(h.requires_grad());
    std::vector<at::Tensor> inputs;
    std::vector<int> where;  // index into the result (0 = h, 1 + i = params[i])
    if (hd.requires_grad()) inputs.push_back(hd), where.push_back(0);
    for (std::size_t i = 0; i < rc->params.size(); ++i)
      if (rc->params[i].requires_grad()) inputs.push_back(rc->params[i]), where.push_back(static_cast<int>(i) + 1);
    variable_list result(rc->params.size() + 2);  // h, params..., the capsule
    if (inputs.empty()) return result;
    variable_list grads;
    {
      at::AutoGradMode on(true);
      at::Tensor y = rc->body(hd);
      grads = torch::autograd::grad({y}, inputs, {grad_out[0]}, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
    }
    for (std::size_t i = 0; i < grads.size(); ++i) result[static_cast<std::size_t>(where[i])] = grads[i];
    return result;
  }
};

struct HeadArgs {
  const TensorFn* logits;
  at::Tensor weight;
  double temperature;
  std::int64_t chunk;
  bool with_entropy;
};

// Logprobs, entropies and (jac defined) each row's gradient of its logprob, chunk by chunk.
void head_chunks(const HeadArgs& a, const at::Tensor& hidden, const at::Tensor& targets, at::Tensor& lp,
                 at::Tensor& ent, at::Tensor* jac) {
  const auto N = hidden.size(0);
  const auto acc = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto opt = hidden.options().dtype(acc);
  lp = at::empty({N}, opt);
  ent = at::empty({a.with_entropy ? N : 0}, opt);
  if (jac != nullptr) *jac = at::empty({N, hidden.size(1)}, opt);
  const double inv_t = 1.0 / a.temperature;
  for (std::int64_t s = 0; s < N; s += a.chunk) {
    const auto n = std::min(a.chunk, N - s);
    auto t = targets.narrow(0, s, n);
    at::Tensor z = (*a.logits)(hidden.narrow(0, s, n)).to(acc);  // [n, V], ours to modify
    if (inv_t != 1.0) z.mul_(inv_t);
    auto lse = at::logsumexp(z, {1}, /*keepdim=*/true);           // [n, 1]
    z.sub_(lse);                                                  // log p
    lp.narrow(0, s, n).copy_(z.gather(1, t.unsqueeze(1)).squeeze(1));
    if (!a.with_entropy && jac == nullptr) continue;
    at::Tensor p = z.exp();
    if (a.with_entropy) ent.narrow(0, s, n).copy_(at::bmm(p.unsqueeze(1), z.unsqueeze(2)).view({n}).neg());
    if (jac != nullptr) {
      // d logp[t] / d h = (onehot(t) - p) W / T. The difference is taken in the accumulation
      // dtype before any cast to W's: in bf16, W[t] - bf16(p W) would cancel to rounding noise
      // for the confident tokens that dominate RL samples.
      p.neg_().scatter_add_(1, t.unsqueeze(1), at::ones({n, 1}, p.options()));
      const auto& W = a.weight;
      jac->narrow(0, s, n).copy_(at::matmul(p.to(W.scalar_type()), W).to(acc).mul_(inv_t));
    }
  }
}

struct HeadFn : torch::autograd::Function<HeadFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& targets,
                               const HeadArgs* a) {
    at::Tensor lp, ent, jac;
    head_chunks(*a, hidden, targets, lp, ent, &jac);
    ctx->save_for_backward({jac});
    ctx->saved_data["dtype"] = static_cast<std::int64_t>(hidden.scalar_type());
    ctx->mark_non_differentiable({ent});
    return {lp, ent};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const at::Tensor jac = ctx->get_saved_variables()[0];
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    at::Tensor gh;
    if (grad_out[0].defined()) gh = (grad_out[0].unsqueeze(1) * jac).to(dtype);
    return {gh, at::Tensor(), at::Tensor()};
  }
};

HeadLogprobs plain_autograd_head(const TensorFn& logits, const at::Tensor& hidden, const at::Tensor& targets,
                                 double temperature, std::int64_t chunk, bool with_entropy) {
  std::vector<at::Tensor> lps, ents;
  const auto N = hidden.size(0);
  for (std::int64_t s = 0; s < N; s += chunk) {
    const auto n = std::min(chunk, N - s);
    auto logp = at::log_softmax(logits(hidden.narrow(0, s, n)) / temperature, -1);
    lps.push_back(logp.gather(1, targets.narrow(0, s, n).unsqueeze(1)).squeeze(1));
    if (with_entropy) {
      at::NoGradGuard ng;
      auto ld = logp.detach();
      ents.push_back(-(ld.exp() * ld).sum(-1));
    }
  }
  const auto acc = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  HeadLogprobs out;
  out.logprobs = lps.empty() ? at::zeros({0}, hidden.options().dtype(acc)) : at::cat(lps);
  if (with_entropy) out.entropy = ents.empty() ? at::zeros({0}, hidden.options().dtype(acc)) : at::cat(ents);
  return out;
}

}  // namespace

at::Tensor checkpoint(TensorFn body, const at::Tensor& h, const std::vector<at::Tensor>& params) {
  bool needs_grad = h.requires_grad();
  for (const auto& p : params) needs_grad = needs_grad || p.requires_grad();
  if (!c10::GradMode::is_enabled() || !needs_grad) return body(h);
  auto rc = c10::make_intrusive<Recompute>();
  rc->body = std::move(body);
  rc->params = params;
  return CheckpointFn::apply(h, at::TensorList(params), std::move(rc))[0];
}

HeadLogprobs lm_head_logprobs(const TensorFn& logits, const at::Tensor& weight, const at::Tensor& hidden,
                              const at::Tensor& targets, double temperature, std::int64_t chunk,
                              bool with_entropy) {
  HeadArgs a{&logits, weight, temperature, std::max<std::int64_t>(1, chunk), with_entropy};
  HeadLogprobs out;
  if (c10::GradMode::is_enabled() && weight.requires_grad()) {
    // The head itself is trained (full fine-tuning): plain autograd, which also differentiates W
    // (the custom step gives hidden's gradient only) and keeps each chunk for the backward pass.
    return plain_autograd_head(logits, hidden, targets, temperature, a.chunk, with_entropy);
  }
  if (c10::GradMode::is_enabled() && hidden.requires_grad()) {
    auto r = HeadFn::apply(hidden, targets, &a);
    out.logprobs = r[0];
    out.entropy = r[1];
  } else {
    head_chunks(a, hidden, targets, out.logprobs, out.entropy, nullptr);
  }
  if (!with_entropy) out.entropy = at::Tensor();
  return out;
}

}  // namespace lorasync::model
