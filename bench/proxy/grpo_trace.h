// bench/proxy/grpo_trace.h: a GRPO-shaped request trace for `bench proxy` and proxy tests.
// P prompts, each a shared template (template_tokens) followed by a problem of 80-400 token ids,
// sent as G consecutive requests with n = 1 under the current adapter (the fields the trainer sends); the adapter advances every
// `prompts_per_version` prompts (a weight sync). Deterministic for a seed.
// Thread-safety: pure function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorasync::bench {

struct TraceOptions {
  int prompts = 64;
  int group = 8;                 // G
  int template_tokens = 32;
  int problem_min = 80, problem_max = 400;
  int prompts_per_version = 16;  // adapter advances (policy-v1, policy-v2, ...)
  // What the trainer asks for (src/rl/pipeline.cpp): per-token logprobs and token ids, so that a
  // replica's answer carries max_tokens ids and logprobs per choice (completion_body.h).
  int max_tokens = 256;
  bool logprobs = true;           // "logprobs": 0
  bool return_token_ids = true;
  bool stream = false;
  std::uint64_t seed = 1;
};

struct TraceRequest {
  std::string body;     // /v1/completions JSON
  int prompt_index = 0;
  std::string adapter;
};

std::vector<TraceRequest> make_grpo_trace(const TraceOptions& o);

}  // namespace lorasync::bench
