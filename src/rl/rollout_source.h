// rl/rollout_source.h: where a group's samples come from (the seam between the pipeline's
// dispatch, staleness and retries, and what one rollout is).
//
// The pipeline (rl/pipeline.h) admits a prompt, then awaits RolloutSource::rollout() for it. The
// source makes as many completion calls as it needs through `complete` (the pipeline's: it names
// the current adapter version, retries transport errors and 5xx with backoff, and reports a
// cancellation by a version switch, a prompt that failed all its retries, or a stop), and returns
// the group, or the first call's outcome that was not an answer.
//   single turn: one call with n = G on the problem's prompt; rewards by grpo.reward_funcs later.
//   episodes (rl/episode.h): G episodes against an environment, n = 1 per model turn, each turn's
//     prompt the previous one's tokens plus the sampled tokens plus the environment's; rewards
//     from the environment (the group comes back scored: Group::prescored).
// Thread model: rollout() runs on the pipeline's rollout thread (one io_context); a source does
// blocking work (an environment's worker) on threads of its own.
#pragma once

#include <utility>  // before Asio's coroutine headers (Boost 1.74 + g++ 12)

#include <boost/asio/awaitable.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rl/completion_response.h"
#include "rl/config.h"
#include "rl/dataset.h"
#include "rl/rollout_types.h"

namespace lorasync::rl {

using CompleteFn = std::function<boost::asio::awaitable<TurnAnswer>(TurnRequest)>;

struct RolloutOutcome {
  RolloutKind kind = RolloutKind::kOk;
  Group group;                                  // kOk: members, version, sync_index, prescored
  std::string why;
  std::map<std::string, std::int64_t> counters;  // added to the pipeline's (episode counts)
};

class RolloutSource {
 public:
  virtual ~RolloutSource() = default;
  virtual boost::asio::awaitable<RolloutOutcome> rollout(const PromptRef& prompt, const Problem& problem,
                                                         CompleteFn complete) = 0;
  // Counters the source owns, registered at zero so they appear from the first step.
  virtual std::vector<std::string> counter_names() const { return {}; }
  // Ends blocking work at once (stop()).
  virtual void shutdown() {}
  // After the rollout thread has stopped: waits for the source's own threads, so that nothing
  // posts into the pipeline's io_context any more (it is destroyed before the source).
  virtual void join() {}
};

// One call with n = G on the problem's prompt; max_tokens as trainer.md §1.2.
std::unique_ptr<RolloutSource> make_single_turn_source(const TrainConfig& cfg);

}  // namespace lorasync::rl
