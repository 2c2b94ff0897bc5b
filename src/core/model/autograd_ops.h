// core/model/autograd_ops.h: the two custom autograd steps that make training memory grow
// linearly in the packed row (trainer.md §3), device-agnostic (ATen ops only).
//
//  - checkpoint(body, h, params): body(h) whose activations are not kept for the backward pass;
//    only h is, and the backward pass runs body again with gradients (one extra forward of the
//    body) before differentiating it. Used per decoder layer (batching.activation_checkpointing).
//  - lm_head_logprobs(...): log_softmax(h W^T / temperature)[target] of N rows in chunks. Each
//    logprob depends on its own row only, so its gradient with respect to that row is a d-vector,
//    (W[target] - softmax(z) W) / temperature, computed in the forward pass from the chunk's
//    probabilities: the backward pass is one multiply, no [N, vocab] tensor is kept (autograd
//    through log_softmax keeps every chunk's [C, vocab]) and nothing is recomputed.
// Thread-safety: reentrant.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace lorasync::model {

using TensorFn = std::function<at::Tensor(const at::Tensor&)>;

// Runs body(h). When gradient mode is on and h or one of params requires a gradient, the result is
// differentiable with respect to h and params (the tensors with gradient that body reads besides
// h, such as a layer's LoRA factors) but body's intermediate tensors are freed; body (with what it
// captures) is kept until the backward pass and must compute the same values when run again (no
// dropout, no state). Otherwise it is body(h) unchanged.
at::Tensor checkpoint(TensorFn body, const at::Tensor& h, const std::vector<at::Tensor>& params);

struct HeadLogprobs {
  at::Tensor logprobs;  // [N] in the accumulation dtype (fp32, fp64 for fp64), differentiable in hidden
  at::Tensor entropy;   // [N] entropy of softmax(z / T), no gradient; only with_entropy
};
// logits(rows) must return the fp32 (fp64) logits rows W^T of hidden rows [n, d]; weight is W
// [vocab, d]. targets: int64 [N] token ids, already checked against the vocabulary. When W itself
// requires a gradient (full fine-tuning), plain autograd through log_softmax is used instead, so
// W is differentiated too.
HeadLogprobs lm_head_logprobs(const TensorFn& logits, const at::Tensor& weight, const at::Tensor& hidden,
                              const at::Tensor& targets, double temperature, std::int64_t chunk,
                              bool with_entropy);

}  // namespace lorasync::model
