// engine/sampler.h: turns a batch of logits into tokens with per-sequence parameters.
//
// Order per row: repetition penalty -> greedy (temperature 0) or logits / temperature -> top-k ->
// top-p -> min-p -> renormalised log-softmax (the "processed" logprobs) -> inverse-CDF draw with
// the sequence's own generator. Each row is computed independently of the others, so a seeded
// request gets the same tokens whatever else shares its batch. The reported logprob of the
// sampled token is the processed one: log_softmax(logits / T) when no truncation is active, what
// the trainer recomputes. Greedy reports log_softmax(logits) (T = 1).
// Greedy and untruncated rows are computed straight from the logits with our vectorised kernels
// (two passes over the row, no log-softmax tensor, a heap for top logprobs); truncated rows, and
// every row when model::set_cpu_fast_paths(false), use the libtorch expression. Rows run on the
// intra-op threads.
// Thread-safety: stateless functions; generators belong to their sequences.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <vector>

#include "engine/request.h"

namespace lorasync::engine {

struct SampleRow {
  const SamplingParams* params = nullptr;
  std::mt19937_64* rng = nullptr;
  const std::vector<std::int32_t>* history = nullptr;  // prompt + output, for the penalty
};

// logits: fp32 [B, V] (any device). Returns B tokens with logprobs (and top-k when asked).
std::vector<TokenOut> sample_batch(const at::Tensor& logits, const std::vector<SampleRow>& rows);

}  // namespace lorasync::engine
