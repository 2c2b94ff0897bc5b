// rl/pipeline_parts.cpp: the pipeline's pure pieces (group sums, the dispatch permutation, version
// names, the counter-based generator behind every random choice of the trainer).
#include <limits>

#include "rl/pipeline.h"
#include "util/random.h"

namespace lorasync::rl {

std::int64_t Member::model_tokens() const {
  if (mask.empty()) return static_cast<std::int64_t>(ids.size());
  std::int64_t n = 0;
  for (auto m : mask) n += m != 0;
  return n;
}

double Group::mean_reward() const {
  double s = 0;
  std::int64_t n = 0;
  for (const auto& m : members)
    if (m.valid()) s += m.reward, ++n;
  return n ? s / static_cast<double>(n) : 0.0;
}

std::int64_t Group::tokens() const {
  std::int64_t t = 0;
  for (const auto& m : members) t += static_cast<std::int64_t>(m.ids.size());
  return t;
}

std::vector<std::int64_t> epoch_permutation(std::int64_t n, std::int64_t seed, std::int64_t epoch, bool shuffle) {
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = i;
  if (!shuffle) return p;
  std::uint64_t state = splitmix64(static_cast<std::uint64_t>(seed) * 0x100000001b3ull ^ splitmix64(static_cast<std::uint64_t>(epoch)));
  for (std::int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates with our own generator: portable
    state = splitmix64(state);
    const auto j = static_cast<std::int64_t>(state % static_cast<std::uint64_t>(i + 1));
    std::swap(p[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(j)]);
  }
  return p;
}

std::optional<std::int64_t> parse_version_name(const std::string& name, const std::string& prefix) {
  const std::string head = prefix + "-v";
  if (name.size() <= head.size() || name.compare(0, head.size(), head) != 0) return std::nullopt;
  std::int64_t v = 0;
  for (std::size_t i = head.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (std::numeric_limits<std::int64_t>::max() / 10 - 9)) return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  if (name[head.size()] == '0') return std::nullopt;  // no leading zeros: one name per version
  return v;
}

}  // namespace lorasync::rl
