// demo/quality.h: the demo's quality bar (spec demo.md, "What it must show"): what `lorasync demo`
// checks at its end, failing (exit 3, kDemoDidNotLearn) with the numbers when the run did not learn.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorasync::demo {

// `lorasync demo`'s exit status when the run finished but missed its quality bar.
inline constexpr int kDemoDidNotLearn = 3;

struct QualityBar {
  double min_accuracy_gain = 0.25;  // held-out accuracy, trained adapter minus base model (absolute)
  double min_reward_gain = 0.2;     // mean reward of the last 10 steps minus the first 10
};

struct DemoOutcome {
  double accuracy_base = 0, accuracy_trained = 0;
  double reward_first10 = 0, reward_last10 = 0;
  std::int64_t failed_requests = 0;
  std::int64_t steps = 0;
  double adapter_loads_replica0 = 0, adapter_loads_replica1 = 0;
};

// The criteria the outcome misses, each a sentence with its numbers; empty when the bar is met.
std::vector<std::string> quality_failures(const DemoOutcome& o, const QualityBar& bar);

}  // namespace lorasync::demo
