// rl/packed_forward.h: the trainer's forward over one packed row (trainer.md §3): the model's
// packed_logprobs (core/model/logprobs.h) with entropy, differentiable through the adapter.
// A row holds several samples back to back; positions restart per sample and attention never
// crosses a sample boundary. For a sample at row offset o with prompt length P and completion
// length T, positions o+P-1 .. o+P+T-2 predict its completion tokens.
// Thread-safety: reentrant; the model is read, the adapter's tensors get gradients.
#pragma once

#include <cstdint>
#include <vector>

#include "core/model/logprobs.h"

namespace lorasync::rl {

using PackedSample = model::LogprobItem;  // prompt + completion token ids
using RowOutput = model::PackedLogprobs;  // logprobs (with grad), entropy, offsets

// adapter may be null (the base model: the KL reference).
inline RowOutput packed_row_logprobs(const model::DecoderModel& model, const model::LoraAdapter* adapter,
                                     const std::vector<PackedSample>& samples, double temperature,
                                     std::int64_t logits_chunk = 2048, bool checkpoint_layers = false) {
  return model::packed_logprobs(model, adapter, samples, temperature, logits_chunk, /*with_entropy=*/true,
                                checkpoint_layers);
}

}  // namespace lorasync::rl
