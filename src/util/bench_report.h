// util/bench_report.h: the output contract of every `lorasync bench ...` (see docs/benchmarks.md).
//
// Each measurement is one JSON object on stdout:
//   {"bench": "...", "metric": "...", "value": v, "unit": "...", "baseline": b, "ratio": v/b,
//    "config": {...}}
// and, at the end, a readable table on stderr. Benchmarks always run their baseline in the same
// process, so the ratio is meaningful on a noisy shared machine.
// Thread-safety: not thread-safe; one reporter per benchmark run.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace lorasync {

struct BenchRecord {
  std::string bench;                // "gemm", "forward", ...
  std::string metric;               // "prefill_tokens_per_s", ...
  double value = 0;                 // the measured number
  std::string unit;                 // "tokens/s", "GFLOP/s", "ms", ...
  std::optional<double> baseline;   // the same-run baseline, when there is one
  nlohmann::json config = nlohmann::json::object();  // shapes, batch, dtype, ...
};

class BenchReporter {
 public:
  // Prints the JSON line at once (flushed) and keeps the record for the table.
  void emit(BenchRecord record);
  // The readable table, on stderr.
  void print_table() const;
  const std::vector<BenchRecord>& records() const { return records_; }

 private:
  std::vector<BenchRecord> records_;
};

// Wall-clock seconds of a monotonic clock.
double now_seconds();

// Percentile (0..100) of unsorted samples, linear interpolation; 0 for an empty set.
double percentile(std::vector<double> samples, double p);

// `n` pairs of adjacent runs of a candidate (run(true)) and its baseline (run(false)), the order
// swapped every pair so that a drift of the machine's pace hurts both alike: {candidate, baseline}
// per pair, for best-of-each figures and the median of the pairs' ratios.
std::vector<std::pair<double, double>> alternate_pairs(int n, const std::function<double(bool)>& run);

}  // namespace lorasync
