// One group's rewards (contracts in scoring.h).
#include "rl/scoring.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <thread>

#include "core/tokenizer/tokenizer.h"
#include "reward/reward_fn.h"
#include "util/log.h"

namespace lorasync::rl {

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct AtomicCounts {
  std::atomic<std::int64_t> timeouts{0}, crashed{0}, invalid{0}, errors{0};
};

void score_one(Member& m, const Problem& pr, const reward::RewardFunction& fn, const tok::Tokenizer& tokenizer,
               const ScoringRules& rules, AtomicCounts& counts) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  if (m.finish == "length") {
    m.reward = rules.truncated_reward;
    return;
  }
  std::vector<std::int32_t> ids = m.ids;
  if (!ids.empty() && rules.stop_ids != nullptr &&
      std::find(rules.stop_ids->begin(), rules.stop_ids->end(), ids.back()) != rules.stop_ids->end())
    ids.pop_back();
  const std::string text = tokenizer.decode(ids, /*skip_special=*/true);
  reward::RewardInput in{pr.problem, text, ids, m.finish, pr.answers};
  const double r0 = seconds_now();
  try {
    auto out = fn.score(in);
    m.reward = out.reward;
    m.parts.clear();
    for (const auto& c : out.components) m.parts.push_back(c.value);
    if (m.parts.empty()) m.parts.push_back(out.reward);
  } catch (const reward::RewardCallFailed& e) {
    // External rewards enforce their own hard deadline (the call was killed or abandoned).
    if (e.kind() != reward::RewardFailure::kUnavailable) LS_LOG_WARN("trainer", "reward on prompt {}: {}", pr.index, e.what());
    m.reward = kNaN;
    switch (e.kind()) {
      case reward::RewardFailure::kTimeout: ++counts.timeouts; break;
      case reward::RewardFailure::kCrashed: ++counts.crashed; break;
      case reward::RewardFailure::kInvalidOutput: ++counts.invalid; break;
      case reward::RewardFailure::kUnavailable: ++counts.errors; break;
    }
    return;
  } catch (const std::exception& e) {
    LS_LOG_WARN("trainer", "reward function failed on prompt {}: {}", pr.index, e.what());
    m.reward = kNaN;
    ++counts.errors;
    return;
  }
  if (seconds_now() - r0 > rules.reward_timeout_s) {  // built-ins: late results are discarded
    m.reward = rules.reward_on_timeout;
    ++counts.timeouts;
  }
}

}  // namespace

ScoringCounts score_members(std::vector<Member>& members, const Problem& pr, const reward::RewardFunction& fn,
                            const tok::Tokenizer& tokenizer, const ScoringRules& rules) {
  AtomicCounts counts;
  if (fn.parallel_members() && members.size() > 1) {
    std::vector<std::thread> ts;
    ts.reserve(members.size());
    for (auto& m : members) ts.emplace_back([&, mp = &m] { score_one(*mp, pr, fn, tokenizer, rules, counts); });
    for (auto& t : ts) t.join();
  } else {
    for (auto& m : members) score_one(m, pr, fn, tokenizer, rules, counts);
  }
  return {counts.timeouts.load(), counts.crashed.load(), counts.invalid.load(), counts.errors.load()};
}

}  // namespace lorasync::rl
