// The single-turn rollout source (contracts in rollout_source.h).
#include "rl/rollout_source.h"

#include <algorithm>

namespace lorasync::rl {

namespace {

class SingleTurnSource final : public RolloutSource {
 public:
  explicit SingleTurnSource(const TrainConfig& cfg) : cfg_(cfg) {}

  boost::asio::awaitable<RolloutOutcome> rollout(const PromptRef&, const Problem& problem, CompleteFn complete) override {
    const auto& g = cfg_.generation;
    TurnRequest req;
    req.prompt = problem.prompt_ids;
    req.n = cfg_.grpo.num_generations;
    req.max_tokens = std::min<std::int64_t>(g.max_new_tokens, g.context_len - static_cast<std::int64_t>(problem.prompt_ids.size()));
    TurnAnswer a = co_await complete(std::move(req));
    RolloutOutcome out;
    out.kind = a.kind;
    out.why = a.why;
    if (a.kind == RolloutKind::kOk) {
      out.group.members = std::move(a.members);
      out.group.version = a.version;
      out.group.sync_index = a.sync_index;
      out.group.request_s = a.request_s;
    }
    co_return out;
  }

 private:
  const TrainConfig& cfg_;
};

}  // namespace

std::unique_ptr<RolloutSource> make_single_turn_source(const TrainConfig& cfg) { return std::make_unique<SingleTurnSource>(cfg); }

}  // namespace lorasync::rl
