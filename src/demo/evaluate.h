// demo/evaluate.h: accuracy of a model on demo problems, graded by the real verifier.
//
// Prompts are the trainer's `chatml` prompts (system prompt + problem); completions are generated
// in batches (one KV cache for the whole batch, prefill then one token per live sequence per
// step, stop at the eos ids or max_new_tokens) and graded with reward::grade against the
// reference answer: the last \boxed{} must equal it. A completion cut at max_new_tokens counts
// as wrong, as the trainer's reward does. Sampling draws from softmax(logits / temperature)
// with a generator seeded by `seed` (temperature 0 = greedy), so results are reproducible for a
// fixed seed, batch size and thread count.
// Thread-safety: reads the model only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/model/decoder_model.h"
#include "core/tokenizer/tokenizer.h"
#include "demo/task.h"

namespace lorasync::demo {

struct EvalOptions {
  std::string system_prompt;  // "" = no system message
  std::int64_t max_new_tokens = 64;
  double temperature = 1.0;            // 0 = greedy
  std::uint64_t seed = 0;              // sampling generator
  std::int64_t batch_size = 128;       // sequences decoded together
  std::vector<std::int64_t> stop_ids;  // empty = the tokenizer's eos
};

struct EvalResult {
  std::int64_t n = 0;  // completions graded
  std::int64_t n_correct = 0;
  std::int64_t n_boxed = 0;      // completions containing "\boxed{"
  std::int64_t n_truncated = 0;  // cut at max_new_tokens
  double mean_tokens = 0;        // generated tokens per completion
  double accuracy() const {
    return n ? static_cast<double>(n_correct) / static_cast<double>(n) : 0;
  }
  std::vector<std::string> completions;  // decoded text, in row order
  std::vector<bool> correct;             // verdict per row
};

EvalResult evaluate(const model::DecoderModel& model, const tok::Tokenizer& tokenizer,
                    const std::vector<TaskRow>& rows, const EvalOptions& options);

// The trainer's chatml prompt of one problem, tokenized (special tokens parsed).
std::vector<std::int64_t> prompt_ids(const tok::Tokenizer& tokenizer,
                                     const std::string& system_prompt, const std::string& problem);

// Batched generation: completions (without the prompt) for each prompt; `stopped[i]` is true when
// a stop id ended sequence i. Exposed for tests.
struct BatchGeneration {
  std::vector<std::vector<std::int64_t>> ids;
  std::vector<bool> stopped;
};
BatchGeneration generate_batch(const model::DecoderModel& model,
                               const std::vector<std::vector<std::int64_t>>& prompts,
                               std::int64_t max_new_tokens, double temperature, std::uint64_t seed,
                               const std::vector<std::int64_t>& stop_ids);

}  // namespace lorasync::demo
