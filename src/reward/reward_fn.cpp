// Reward functions (contracts in reward_fn.h).
#include "reward/reward_fn.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "reward/extract.h"
#include "util/error.h"

namespace lorasync::reward {

RewardOutput MathBoxedReward::score(const RewardInput& in) const {
  RewardOutput out;
  out.truncated = in.finish_reason == "length";
  if (out.truncated) {
    out.reward = std::clamp(options_.truncated_reward, 0.0, 1.0);
    out.reason = "truncated";
    out.components.push_back({name(), out.reward, 1});
    return out;
  }
  GradeResult g = grade(in.completion, in.references, options_.grade);
  out.correct = g.correct;
  out.reward = g.correct ? 1.0 : 0.0;
  out.extracted = std::move(g.extracted);
  out.reason = std::move(g.reason);
  out.components.push_back({name(), out.reward, 1});
  return out;
}

RewardOutput FormatBoxedReward::score(const RewardInput& in) const {
  RewardOutput out;
  out.truncated = in.finish_reason == "length";
  auto box = out.truncated ? std::nullopt : extract_last_boxed(after_think(in.completion));
  out.reward = box ? 1.0 : 0.0;
  out.reason = out.truncated ? "truncated" : box ? "has_box" : "no_box";
  if (box) out.extracted = *box;
  out.components.push_back({name(), out.reward, 1});
  return out;
}

CompositeReward::CompositeReward(
    std::vector<std::pair<std::shared_ptr<const RewardFunction>, double>> parts)
    : parts_(std::move(parts)) {
  if (parts_.empty()) throw_invalid("composite reward needs at least one function");
  for (const auto& [fn, w] : parts_) {
    if (!fn) throw_invalid("composite reward: null function");
    if (!std::isfinite(w) || w < 0)
      throw_invalid("composite reward: weight {} of '{}' must be finite and >= 0", w, fn->name());
  }
}

std::string CompositeReward::name() const {
  std::string n = "composite(";
  for (std::size_t k = 0; k < parts_.size(); ++k) {
    if (k > 0) n += ",";
    n += parts_[k].first->name();
  }
  return n + ")";
}

RewardOutput CompositeReward::score(const RewardInput& in) const {
  RewardOutput out;
  double total = 0;
  for (const auto& [fn, w] : parts_) {
    RewardOutput r = fn->score(in);
    total += w * r.reward;
    out.components.push_back({fn->name(), r.reward, w});
    // The first function that grades correctness supplies the verdict details.
    if (out.reason.empty()) {
      out.correct = r.correct;
      out.extracted = r.extracted;
      out.reason = r.reason;
    }
    out.truncated = out.truncated || r.truncated;
  }
  out.reward = std::clamp(total, 0.0, 1.0);
  return out;
}

bool CompositeReward::parallel_members() const {
  return std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return p.first->parallel_members(); });
}

void CompositeReward::shutdown() const {
  for (const auto& p : parts_) p.first->shutdown();
}

const char* failure_name(RewardFailure f) {
  switch (f) {
    case RewardFailure::kTimeout: return "timeout";
    case RewardFailure::kCrashed: return "crashed";
    case RewardFailure::kInvalidOutput: return "invalid_output";
    case RewardFailure::kUnavailable: return "unavailable";
  }
  return "unknown";
}

std::shared_ptr<const RewardFunction> make_reward_function(std::string_view name) {
  if (name == "math_boxed") return std::make_shared<MathBoxedReward>();
  if (name == "format_boxed") return std::make_shared<FormatBoxedReward>();
  throw_invalid("unknown reward function '{}' (known: math_boxed, format_boxed; external rewards are defined in [rewards.NAME] tables)", name);
}

std::shared_ptr<const RewardFunction> make_reward_from_spec(std::string_view spec) {
  std::vector<std::pair<std::shared_ptr<const RewardFunction>, double>> parts;
  std::size_t start = 0;
  bool any_weight = false;
  while (start <= spec.size()) {
    std::size_t end = spec.find(',', start);
    if (end == std::string_view::npos) end = spec.size();
    std::string_view item = spec.substr(start, end - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) throw_invalid("reward spec '{}': empty item", spec);
    double w = 1;
    std::size_t colon = item.find(':');
    std::string_view fname = item.substr(0, colon);
    if (colon != std::string_view::npos) {
      std::string ws(item.substr(colon + 1));
      char* endp = nullptr;
      w = std::strtod(ws.c_str(), &endp);
      if (ws.empty() || endp != ws.c_str() + ws.size())
        throw_invalid("reward spec '{}': bad weight '{}'", spec, ws);
      any_weight = true;
    }
    parts.emplace_back(make_reward_function(fname), w);
    start = end + 1;
  }
  if (parts.size() == 1 && !any_weight) return parts[0].first;
  return std::make_shared<CompositeReward>(std::move(parts));
}

}  // namespace lorasync::reward
