// core/model/logprobs.h: reference computations on top of the model, used by tools and tests to
// check the server and the trainer: completion logprobs (`lorasync logprobs`) and a plain
// one-sequence generation loop (`lorasync generate`).
//
// Logprobs are log_softmax(logits / temperature) of the given completion tokens, in fp32, the
// "processed" logprobs the server returns with top_p = 1 and no top-k.
// Thread-safety: functions are reentrant; the model is only read.
#pragma once

#include <cstdint>
#include <vector>

#include "core/model/decoder_model.h"

namespace lorasync::model {

struct LogprobItem {
  std::vector<std::int64_t> prompt;      // at least one token
  std::vector<std::int64_t> completion;  // scored tokens
};

// Completion log-probs of items packed into one flat batch (a training row): segments never
// attend to each other, positions restart per segment, and the LM head runs only at completion
// positions, in chunks of `chunk` rows, logits converted to fp32 (fp64 for an fp64 model) before
// temperature and log-softmax; the full [tokens, vocab] logits are never built, and the backward
// pass keeps no chunk of them either (lm_head_logprobs, autograd_ops.h). Differentiable through
// the adapter (callers add a NoGradGuard when they only read). checkpoint_layers: each decoder
// layer's activations are recomputed in the backward pass instead of kept (one extra forward).
struct PackedLogprobs {
  at::Tensor logprobs;                // [sum T_i]
  at::Tensor entropy;                 // [sum T_i] entropy of softmax(z / T), no grad; only with_entropy
  std::vector<std::int64_t> offsets;  // item i's tokens are [offsets[i], offsets[i+1])
};
PackedLogprobs packed_logprobs(const DecoderModel& model, const LoraAdapter* adapter,
                               const std::vector<LogprobItem>& items, double temperature,
                               std::int64_t chunk = 2048, bool with_entropy = false,
                               bool checkpoint_layers = false);

// packed_logprobs without gradients, as plain numbers per item.
std::vector<std::vector<float>> completion_logprobs(const DecoderModel& model,
                                                    const LoraAdapter* adapter,
                                                    const std::vector<LogprobItem>& items,
                                                    double temperature, std::int64_t chunk = 2048);

struct GenerateOptions {
  std::int64_t max_new_tokens = 16;
  double temperature = 0.0;  // 0 = greedy
  std::uint64_t seed = 0;
  std::vector<std::int64_t> stop_ids;  // generation ends after emitting one of these
};

struct GenerateResult {
  std::vector<std::int64_t> ids;
  std::vector<float> logprobs;  // processed logprob of each generated token (greedy: T = 1)
  bool stopped = false;         // true: a stop id ended it; false: max_new_tokens
};

// Prefill + incremental decode with a KV cache, one sequence.
GenerateResult generate(const DecoderModel& model, const LoraAdapter* adapter,
                        const std::vector<std::int64_t>& prompt, const GenerateOptions& opt);

// Validates ids against the vocabulary; InvalidInput naming `what`, the index and the value.
void check_token_ids(const std::vector<std::int64_t>& ids, std::int64_t vocab, const char* what);

}  // namespace lorasync::model
