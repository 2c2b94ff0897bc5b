// report/metrics_log.h: the trainer's metrics.jsonl (trainer.md §6) read back as per-step rows.
//
// One JSON object per line, each with an integer "step" and numeric metrics; a key absent from a
// line simply has no point at that step (keys with no value are omitted by the trainer). Reading
// rules, chosen for files of real, possibly interrupted or resumed runs:
//   - blank lines are skipped;
//   - a line that is not a JSON object, or has no integer "step", is an InvalidInput error naming
//     the file and the 1-based line number (a torn last line is an error too: the report should
//     not silently hide a broken file);
//   - the same step twice (a run resumed from an earlier checkpoint re-logs steps): the later line
//     replaces the earlier one entirely;
//   - only numeric values are kept (strings, booleans, null, objects are ignored); NaN/Infinity
//     tokens written by non-strict JSON writers are accepted and kept as non-finite values, which
//     the charts skip;
//   - no rows at all is an InvalidInput error.
// Thread-safety: a MetricsLog is immutable after construction; const methods are thread-safe.
#pragma once

#include <cstddef>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::report {

class MetricsLog {
 public:
  // Reads a metrics.jsonl file. NotFound if missing; InvalidInput on a malformed line or no rows.
  static MetricsLog read(const std::filesystem::path& path);
  // Parses JSONL text; `source` names the input in error messages (a path).
  static MetricsLog parse(std::string_view text, const std::string& source);

  std::size_t n_steps() const { return rows_.size(); }
  // Steps in ascending order.
  std::vector<long long> steps() const;
  // Every metric key seen in any row, sorted.
  std::vector<std::string> keys() const;
  bool has(std::string_view key) const;

  // The points of one metric: steps where the key is present, ascending. Non-finite values are
  // kept (callers decide; the charts skip them).
  struct Points {
    std::vector<double> steps;
    std::vector<double> values;
    bool empty() const { return steps.empty(); }
  };
  Points points(std::string_view key) const;
  // Two metrics at the steps where both are present (for bands such as ratio/min..ratio/max).
  struct PairPoints {
    std::vector<double> steps;
    std::vector<double> a;
    std::vector<double> b;
  };
  PairPoints pair_points(std::string_view key_a, std::string_view key_b) const;

  // The value of `key` at `step`, if present.
  std::optional<double> value(long long step, std::string_view key) const;

 private:
  using Row = std::map<std::string, double, std::less<>>;
  std::map<long long, Row> rows_;
};

// Summary statistics of the finite values of a series, for the report's overview table.
struct SeriesStats {
  std::size_t n = 0;  // finite points
  double first = 0, last = 0, min = 0, max = 0, mean = 0;
  double mean_first = 0, mean_last = 0;  // means of the first and last min(n, window) points
};
std::optional<SeriesStats> series_stats(const std::vector<double>& values, std::size_t window = 10);

}  // namespace lorasync::report
