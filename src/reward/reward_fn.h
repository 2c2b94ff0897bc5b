// reward/reward_fn.h: the reward interface the trainer's scorer calls.
//
//   RewardInput (prompt, completion text and token ids, finish reason, reference answers)
//     -> RewardFunction::score() -> RewardOutput {reward in [0,1], details}
//
// Built-in functions (make_reward_function(name)):
//   "math_boxed"  1 when the last \boxed{} of the completion matches any reference (grade.h);
//                 0 without a box; a completion cut at the length limit (finish_reason "length")
//                 gets `truncated_reward` (0 by default, the recipe's rule) whatever it contains.
//   "format_boxed" 1 when the completion (not truncated) contains a complete \boxed{}; a shaping
//                 term meant for small weights in a CompositeReward.
// CompositeReward holds (function, weight) pairs and returns the weighted sum, clamped to [0,1],
// with each function's own value in `details.components`.
// Thread model: score() is const and thread-safe for every function here; one instance can serve
// all scorer threads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reward/grade.h"

namespace lorasync::reward {

struct RewardInput {
  std::string_view prompt;
  std::string_view completion;
  std::span<const std::int32_t> completion_ids;  // may be empty when only text is at hand
  std::string_view finish_reason;                // "stop", "length", ...
  std::vector<std::string> references;           // acceptable answers; any match counts
};

struct RewardComponent {
  std::string name;
  double value = 0;   // the function's own reward in [0,1]
  double weight = 1;  // its weight in a composite
};

struct RewardOutput {
  double reward = 0;       // in [0,1]
  bool correct = false;    // the verifier's verdict (math functions)
  bool truncated = false;  // finish_reason was "length"
  std::string extracted;   // the extracted answer, when there is one
  std::string reason;      // the deciding rule ("string_equal", "no_box", "truncated", ...)
  std::vector<RewardComponent> components;  // per function (composites)
};

// How an external reward call failed (rl/external_reward.h). The trainer gives the member NaN
// (excluded from its group's statistics) and counts the failure by kind.
enum class RewardFailure {
  kTimeout,        // past the call's hard deadline: the process was killed / the request abandoned
  kCrashed,        // the process exited or was killed (rlimit), the connection failed, HTTP 5xx
  kInvalidOutput,  // an answer that is not a finite reward in [0, 1]
  kUnavailable,    // cannot start the command, or shutting down
};
const char* failure_name(RewardFailure f);

class RewardCallFailed : public std::runtime_error {
 public:
  RewardCallFailed(RewardFailure kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  RewardFailure kind() const { return kind_; }

 private:
  RewardFailure kind_;
};

class RewardFunction {
 public:
  virtual ~RewardFunction() = default;
  virtual std::string name() const = 0;
  virtual RewardOutput score(const RewardInput& input) const = 0;
  // True when calls are slow and independent (external processes, servers): the trainer then
  // scores the members of a group concurrently. Built-in functions take microseconds: false.
  virtual bool parallel_members() const { return false; }
  // Abandon every call in progress and refuse new ones (kUnavailable), without waiting on them:
  // used on SIGTERM so that a hung reward never delays the checkpoint. Idempotent.
  virtual void shutdown() const {}
};

struct MathBoxedOptions {
  double truncated_reward = 0;  // reward for a completion cut at the length limit
  GradeOptions grade;           // verifier options (fallback stays off for training)
};

class MathBoxedReward final : public RewardFunction {
 public:
  explicit MathBoxedReward(MathBoxedOptions options = {}) : options_(std::move(options)) {}
  std::string name() const override { return "math_boxed"; }
  RewardOutput score(const RewardInput& input) const override;

 private:
  MathBoxedOptions options_;
};

class FormatBoxedReward final : public RewardFunction {
 public:
  std::string name() const override { return "format_boxed"; }
  RewardOutput score(const RewardInput& input) const override;
};

class CompositeReward final : public RewardFunction {
 public:
  // InvalidInput for an empty list, a null function or a negative/non-finite weight.
  explicit CompositeReward(std::vector<std::pair<std::shared_ptr<const RewardFunction>, double>> parts);
  std::string name() const override;
  RewardOutput score(const RewardInput& input) const override;  // a part's failure propagates
  bool parallel_members() const override;                        // any part's
  void shutdown() const override;                                // every part's

 private:
  std::vector<std::pair<std::shared_ptr<const RewardFunction>, double>> parts_;
};

// "math_boxed", "format_boxed". InvalidInput naming the unknown name (and the known ones).
std::shared_ptr<const RewardFunction> make_reward_function(std::string_view name);

// "math_boxed:1,format_boxed:0.1" -> a CompositeReward; a single name without weight -> that
// function. InvalidInput on a malformed spec.
std::shared_ptr<const RewardFunction> make_reward_from_spec(std::string_view spec);

}  // namespace lorasync::reward
