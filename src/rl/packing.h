// rl/packing.h: token-budget packing of a step's samples into padding-free rows (trainer.md §3).
//
// Deterministic planner: sort samples by length descending (ties by group, then member index),
// open ceil(sum L / row_tokens) rows, put each sample into the row with the smallest sum of L^2
// among the rows where it fits (ties: the lower row index), and open a new row when none fits.
// Sum of L^2 balances the attention cost between rows. Every sample must fit in a row
// (row_tokens >= context_len is validated by the configuration).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

namespace lorasync::rl {

struct PackItem {
  std::int64_t length = 0;  // prompt + completion tokens
  std::int64_t group = 0;   // for the deterministic tie-break
  std::int64_t member = 0;
};

struct PackPlan {
  std::vector<std::vector<std::size_t>> rows;  // indices into the items, in placement order
  std::vector<std::int64_t> row_tokens;        // tokens per row
  double fill = 0;                             // sum tokens / (rows * row_tokens)
  double imbalance = 0;                        // max row sum L^2 / mean row sum L^2
};

PackPlan plan_rows(const std::vector<PackItem>& items, std::int64_t row_tokens);

}  // namespace lorasync::rl
