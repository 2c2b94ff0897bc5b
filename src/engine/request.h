// engine/request.h: what a request asks of the engine and what the engine hands back. Native
// types only: the HTTP layer parses JSON into these and renders these into JSON.
//
// Lifecycle of a request inside the engine:
//   submitted -> waiting -> running (prefill chunks, then decode) -> finished
//                   ^           |
//                   +-- preempted (KV freed, recomputed later) --+
// A request with n > 1 prefills its prompt once, then forks into n sequences that share the
// prompt's KV blocks and sample from the same last-prompt logits with their own generators.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lorasync::engine {

struct SamplingParams {
  std::int64_t max_tokens = 16;        // generated tokens at most (>= 1)
  double temperature = 1.0;            // 0 = greedy
  double top_p = 1.0;                  // nucleus mass in (0, 1]
  std::int64_t top_k = 0;              // 0 or -1 = off
  double min_p = 0.0;                  // keep tokens with p >= min_p * p_max
  double repetition_penalty = 1.0;     // > 0; 1 = off (applied to prompt and output tokens)
  std::optional<std::uint64_t> seed;   // member j of the request uses seed + j
  std::vector<std::string> stop;       // stop strings (not included in the text)
  std::vector<std::int32_t> stop_token_ids;  // extra stop ids (included in token_ids)
  bool ignore_eos = false;             // do not stop at the model's EOS ids
  int n = 1;                           // choices
  std::optional<int> logprobs;         // null: none; 0: sampled token; k > 0: also top-k
  bool skip_special_tokens = true;     // in the returned text
};

enum class FinishReason { kNone, kStop, kLength, kAbort, kError };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "abort", "error", null

struct TokenOut {
  std::int32_t id = 0;
  float logprob = 0;                                  // processed logprob (after truncation)
  std::vector<std::pair<std::int32_t, float>> top;    // top-k processed logprobs, best first
  std::string text;                                   // text this token completed (may be "")
};

// A piece of output for one choice, delivered after an engine step.
struct ChoiceDelta {
  int index = 0;                    // choice index in [0, n)
  std::vector<TokenOut> tokens;     // new tokens
  std::string text;                 // new text (stop strings removed; held back while ambiguous)
  FinishReason finish = FinishReason::kNone;
  std::string error;                // with kError
  bool internal = false;            // with kError: the engine failed (5xx), not the request (404)
};

struct RequestUsage {
  std::int64_t prompt_tokens = 0;
  std::int64_t completion_tokens = 0;   // over all choices
  std::int64_t cached_prompt_tokens = 0;  // prompt tokens whose KV came from the prefix cache
};

// Receives output on the engine thread. Implementations must not block: hand the data to the
// connection's executor and return.
class RequestSink {
 public:
  virtual ~RequestSink() = default;
  virtual void on_output(std::vector<ChoiceDelta> deltas, const RequestUsage& usage, bool done) = 0;
};

struct RequestSpec {
  std::string id;                       // unique; used by abort()
  std::string model;                    // base model name or an adapter name
  std::vector<std::int32_t> prompt;     // token ids (validated by the caller and again here)
  SamplingParams params;
  std::shared_ptr<RequestSink> sink;
};

}  // namespace lorasync::engine
