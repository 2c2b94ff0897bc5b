// rl/scoring.h: one group's rewards (trainer.md §1.4), called by the pipeline's scoring workers.
//
// Per member: a truncated completion ("length") gets `truncated_reward` without a call; otherwise
// the completion is decoded (a trailing stop token dropped) and scored. A failed call leaves NaN
// (the member is excluded from the group's statistics) and is counted by kind; a built-in
// function that returns after `reward_timeout_s` gets `reward_on_timeout`. Members are scored on
// parallel threads when the function says its calls are slow (RewardFunction::parallel_members).
// Thread-safety: pure apart from the reward function's own calls and logging.
#pragma once

#include <cstdint>
#include <vector>

#include "rl/dataset.h"
#include "rl/rollout_types.h"

namespace lorasync::reward {
class RewardFunction;
}
namespace lorasync::tok {
class Tokenizer;
}

namespace lorasync::rl {

struct ScoringRules {
  double truncated_reward = 0;
  double reward_timeout_s = 2;
  double reward_on_timeout = 0;
  const std::vector<std::int64_t>* stop_ids = nullptr;  // a trailing one is not part of the text
};

// Failed calls of one group, by kind (rollout/reward_*_total).
struct ScoringCounts {
  std::int64_t timeouts = 0, crashed = 0, invalid = 0, errors = 0;
};

// Fills members[i].reward and .parts; returns the failures.
ScoringCounts score_members(std::vector<Member>& members, const Problem& problem, const reward::RewardFunction& fn,
                            const tok::Tokenizer& tokenizer, const ScoringRules& rules);

}  // namespace lorasync::rl
