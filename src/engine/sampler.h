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
// intra-op threads. Logits on a GPU are sampled there (sample_batch_tensor_ops).
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

// logits: fp32 [B, V] (any device). Returns B tokens with logprobs (and top-k when asked). CPU
// logits take the host path above; logits on a GPU take sample_batch_tensor_ops.
std::vector<TokenOut> sample_batch(const at::Tensor& logits, const std::vector<SampleRow>& rows);

// The same sampling as tensor operations on the logits' own device (batched log-softmax of x / T,
// the row expression for penalised or truncated rows, the inverse-CDF draw over block sums in
// double with each row's own uniform), so only ids, logprobs and the asked top logprobs reach the
// host: a few bytes per row instead of [B, V] fp32 (39 MB at batch 64 on the Qwen2 vocabulary).
// The same tokens as the host path for the same generators, except when a uniform falls within
// rounding of a token boundary. Runs on CPU tensors too: the tests compare it with the host path.
std::vector<TokenOut> sample_batch_tensor_ops(const at::Tensor& logits, const std::vector<SampleRow>& rows);

}  // namespace lorasync::engine
