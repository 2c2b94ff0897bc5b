#include "demo/quality.h"

#include <fmt/format.h>

#include <cmath>

namespace lorasync::demo {

std::vector<std::string> quality_failures(const DemoOutcome& o, const QualityBar& bar) {
  std::vector<std::string> out;
  const double acc_gain = o.accuracy_trained - o.accuracy_base;
  // NaN (a missing figure) fails every comparison below, as it should.
  if (!(acc_gain >= bar.min_accuracy_gain))
    out.push_back(fmt::format("held-out accuracy rose by {:+.3f} ({:.3f} -> {:.3f}), below the bar of +{:.3f}", acc_gain,
                              o.accuracy_base, o.accuracy_trained, bar.min_accuracy_gain));
  const double reward_gain = o.reward_last10 - o.reward_first10;
  if (o.steps < 20)
    out.push_back(fmt::format("{} GRPO steps: the reward bar compares the first 10 steps with the last 10, so it needs "
                              "at least 20",
                              o.steps));
  else if (!(reward_gain >= bar.min_reward_gain))
    out.push_back(fmt::format("mean reward of the last 10 steps rose by {:+.3f} ({:.3f} -> {:.3f}) over the first 10, "
                              "below the bar of +{:.3f}",
                              reward_gain, o.reward_first10, o.reward_last10, bar.min_reward_gain));
  if (o.failed_requests != 0) out.push_back(fmt::format("{} rollout requests failed", o.failed_requests));
  if (o.adapter_loads_replica0 != o.adapter_loads_replica1)
    out.push_back(fmt::format("the replicas loaded different numbers of adapter versions ({:.0f} and {:.0f})",
                              o.adapter_loads_replica0, o.adapter_loads_replica1));
  return out;
}

}  // namespace lorasync::demo
