#include "rl/advantages.h"

#include <cmath>

#include "util/error.h"

namespace lorasync::rl {

AdvantageMode parse_advantage_mode(const std::string& name) {
  if (name == "dr_grpo") return AdvantageMode::kDrGrpo;
  if (name == "grpo") return AdvantageMode::kGrpo;
  throw_invalid("grpo.advantage must be \"dr_grpo\" or \"grpo\", got \"{}\"", name);
}

std::optional<GroupAdvantages> group_advantages(const std::vector<double>& rewards, AdvantageMode mode) {
  double sum = 0;
  int n = 0;
  for (double r : rewards)
    if (!std::isnan(r)) {
      sum += r;
      ++n;
    }
  if (n < 2) return std::nullopt;
  GroupAdvantages g;
  g.mean = sum / n;
  double var = 0;
  for (double r : rewards)
    if (!std::isnan(r)) var += (r - g.mean) * (r - g.mean);
  g.std = std::sqrt(var / n);
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
