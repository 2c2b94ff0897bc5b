#include "rl/advantages.h"

#include <cmath>

#include "util/error.h"

namespace lorasync::rl {

AdvantageMode parse_advantage_mode(const std::string& name) {
  if (name == "dr_grpo") return AdvantageMode::kDrGrpo;
  if (name == "grpo") return AdvantageMode::kGrpo;
  throw_invalid("grpo.advantage must be \"dr_grpo\" or \"grpo\", got \"{}\"", name);
}

RewardStats reward_stats(const std::vector<double>& rewards) {
  RewardStats st;
  double sum = 0;
  for (double r : rewards)
    if (!std::isnan(r)) {
      sum += r;
      ++st.n;
    }
  if (st.n == 0) return st;
  st.mean = sum / st.n;
  double var = 0;
  for (double r : rewards)
    if (!std::isnan(r)) var += (r - st.mean) * (r - st.mean);
  st.std = std::sqrt(var / st.n);
  return st;
}

std::optional<GroupAdvantages> group_advantages(const std::vector<double>& rewards, AdvantageMode mode) {
  const RewardStats st = reward_stats(rewards);
  if (st.n < 2) return std::nullopt;
  GroupAdvantages g;
  g.mean = st.mean;
  g.std = st.std;
  for (double r : rewards) {
    if (std::isnan(r)) {
      g.advantages.push_back(0.0);
      continue;
    }
    const double a = r - g.mean;
    g.advantages.push_back(mode == AdvantageMode::kGrpo ? a / (g.std + 1e-8) : a);
  }
  return g;
}

}  // namespace lorasync::rl
