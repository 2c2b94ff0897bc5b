#include "rl/packing.h"

#include <algorithm>
#include <numeric>

#include "util/error.h"

namespace lorasync::rl {

PackPlan plan_rows(const std::vector<PackItem>& items, std::int64_t row_tokens) {
  if (row_tokens <= 0) throw_invalid("batching.row_tokens must be positive, got {}", row_tokens);
  std::vector<std::size_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const auto& x = items[a];
    const auto& y = items[b];
    if (x.length != y.length) return x.length > y.length;
    if (x.group != y.group) return x.group < y.group;
    return x.member < y.member;
  });
  std::int64_t total = 0;
  for (const auto& it : items) {
    if (it.length > row_tokens)
      throw_invalid("a sample of {} tokens does not fit in batching.row_tokens = {}", it.length, row_tokens);
    total += it.length;
  }
  PackPlan plan;
  const std::int64_t n_rows = (total + row_tokens - 1) / row_tokens;
  plan.rows.resize(static_cast<std::size_t>(n_rows));
  plan.row_tokens.assign(static_cast<std::size_t>(n_rows), 0);
  std::vector<double> sq(static_cast<std::size_t>(n_rows), 0.0);
  for (std::size_t idx : order) {
    const auto L = items[idx].length;
    std::size_t best = plan.rows.size();
    for (std::size_t r = 0; r < plan.rows.size(); ++r)
      if (plan.row_tokens[r] + L <= row_tokens && (best == plan.rows.size() || sq[r] < sq[best])) best = r;
    if (best == plan.rows.size()) {
      plan.rows.emplace_back();
      plan.row_tokens.push_back(0);
      sq.push_back(0);
    }
    plan.rows[best].push_back(idx);
    plan.row_tokens[best] += L;
    sq[best] += static_cast<double>(L) * static_cast<double>(L);
  }
  if (!plan.rows.empty()) {
    plan.fill = static_cast<double>(total) / (static_cast<double>(plan.rows.size()) * static_cast<double>(row_tokens));
    const double mean = std::accumulate(sq.begin(), sq.end(), 0.0) / static_cast<double>(sq.size());
    plan.imbalance = mean > 0 ? *std::max_element(sq.begin(), sq.end()) / mean : 0;
  }
  return plan;
}

}  // namespace lorasync::rl
