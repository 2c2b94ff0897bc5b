// rl/packed_forward.h: the trainer's forward over one packed row (trainer.md §3).
//
// A row holds several samples (prompt + completion) back to back; positions restart at 0 for each
// and attention never crosses a sample boundary (per-segment attention in the model). For a
// sample at row offset o with prompt length P and completion length T, the hidden states at
// positions o+P-1 .. o+P+T-2 predict its completion tokens. The LM head runs only at those
// positions, in chunks of `logits_chunk` rows, and the logits are converted to fp32 (fp64 for an
// fp64 model) before temperature, log-softmax and entropy; the full [T_row, vocab] tensor is never
// built.
// Thread-safety: reentrant; the model is read, the adapter's tensors get gradients.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "core/model/qwen2_model.h"

namespace lorasync::rl {

struct PackedSample {
  std::vector<std::int64_t> prompt;
  std::vector<std::int64_t> completion;
};

struct RowOutput {
  at::Tensor logprobs;  // [sum T_i] log-probs of the completion tokens at temperature (with grad)
  at::Tensor entropy;   // [sum T_i] full-vocabulary entropy of softmax(z / T), no grad
  std::vector<std::int64_t> offsets;  // sample i's tokens are [offsets[i], offsets[i+1])
};

// adapter may be null (the base model: the KL reference).
RowOutput packed_row_logprobs(const model::Qwen2Model& model, const model::LoraAdapter* adapter,
                              const std::vector<PackedSample>& samples, double temperature,
                              std::int64_t logits_chunk = 2048);

}  // namespace lorasync::rl
