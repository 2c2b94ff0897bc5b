// rl/advantages.h: group advantages of GRPO (trainer.md §2.1).
//
//   dr_grpo (default, Precision-RL):  A_i = R_i - mean(R)
//   grpo (TRL AsyncGRPOTrainer):      A_i = (R_i - mean(R)) / (std(R) + 1e-8), population std
// NaN rewards (a failed reward function) are left out of the mean and std and get A = 0; a group
// with fewer than 2 valid members is dropped (and requeued by the caller). A zero-variance group
// gets A = 0 for everyone and is still trained.
// Thread-safety: pure functions.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace lorasync::rl {

enum class AdvantageMode { kDrGrpo, kGrpo };
AdvantageMode parse_advantage_mode(const std::string& name);  // "dr_grpo" | "grpo"

struct GroupAdvantages {
  std::vector<double> advantages;  // one per member
  double mean = 0;                 // over valid members
  double std = 0;                  // population std over valid members
};

// Mean and population std over the non-NaN rewards, and how many there are (0: mean = std = 0).
struct RewardStats {
  double mean = 0, std = 0;
  int n = 0;
};
RewardStats reward_stats(const std::vector<double>& rewards);

// nullopt when the group must be dropped (fewer than 2 non-NaN rewards).
std::optional<GroupAdvantages> group_advantages(const std::vector<double>& rewards, AdvantageMode mode);

}  // namespace lorasync::rl
