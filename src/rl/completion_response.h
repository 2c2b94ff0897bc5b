// rl/completion_response.h: validation of a rollout request's 200 answer (trainer.md §1.2-1.3),
// the trainer's only parser of what a server says it sampled.
//
// Checks the provenance (lorasync.adapter, or the model name stock vLLM echoes) names a known
// version of this run (`prefix`-vN, found by `lookup`, with a matching adapter_sha256 when given),
// n choices with distinct indices, token ids inside the vocabulary and no more than `max_tokens`
// of them (a longer completion was not sampled under the request's parameters), one finite,
// non-positive logprob per token. Fills `out` (members, version, sync index) or returns why not.
// Thread-safety: pure apart from `lookup`.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "rl/rollout_types.h"

namespace lorasync::rl {

// One completion call of a rollout (rl/rollout_source.h) and what came of it.
struct TurnRequest {
  std::vector<std::int64_t> prompt;
  std::int64_t n = 1, max_tokens = 1;
  std::uint64_t seed_salt = 0;  // mixed into the request's seed (0: the prompt's own seed)
  bool first = true;            // the rollout's first call: it fixes the group's version
};

enum class RolloutKind { kOk, kCancelled, kFailed, kStopped };

struct TurnAnswer {
  RolloutKind kind = RolloutKind::kOk;
  std::vector<Member> members;  // kOk: n members (ids, logprobs, finish)
  std::int64_t version = 0, sync_index = 0;
  std::string why;              // kFailed: the last error
  double request_s = 0;
};

using VersionLookup = std::function<std::optional<VersionInfo>(std::int64_t)>;

std::optional<std::string> parse_completion_response(const std::string& body, std::int64_t n, std::int64_t max_tokens, std::int64_t vocab,
                                                     const std::string& prefix, const VersionLookup& lookup, TurnAnswer& out);

}  // namespace lorasync::rl
