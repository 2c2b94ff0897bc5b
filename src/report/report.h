// report/report.h: the run report behind `lorasync report` and `lorasync demo`.
//
// Input, from a trainer output directory (trainer.md §6-7):
//   metrics.jsonl  required; one object per optimizer step (see metrics_log.h for reading rules)
//   run.json       optional; the run label ("run_name") and other scalar facts shown in the header
//   summary.json   optional; a flat object, or {"rows": [{"name", "value", ...}, ...]}, shown as a
//                  table (the demo writes it)
//   eval.json      optional; evaluation results, shown as a table
// Output, under out_dir (default: the run directory), each written atomically:
//   report.html        one self-contained page (inline CSS and SVG; no scripts, no external
//                      resources), openable from disk without a server
//   plots/<name>.svg   each chart of the page as a standalone SVG file (the same SVG text)
// Charts (a chart whose metrics have no finite value is left out and named in the page):
//   reward (+ moving average), ratio (mean, min..max band, 1.0 reference), staleness (mean, max),
//   rollout_queue, step_time (+ rollout wait), weight_sync (+ phases), loss, entropy,
//   completion_length, throughput.
// Optional inputs that cannot be read become warnings (in the result and on the page); a missing
// or malformed metrics.jsonl is an error (NotFound / InvalidInput naming the file and line).
// Thread-safety: functions are thread-safe for distinct output directories.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "report/metrics_log.h"
#include "report/svg_chart.h"

namespace lorasync::report {

struct ReportOptions {
  std::filesystem::path run_dir;          // holds metrics.jsonl (+ optional run/summary/eval.json)
  std::filesystem::path out_dir;          // where report.html and plots/ go; empty = run_dir
  std::string title = "lorasync report";  // page title; the run label is shown under it
  int moving_average_window = 0;          // reward smoothing in steps; 0 = n/10 clamped to [3, 25]
  int chart_width = 640;  // px, the SVG viewBox (the page scales charts to its grid)
  int chart_height = 300;
};

struct ReportResult {
  std::filesystem::path html;                // <out>/report.html
  std::vector<std::filesystem::path> plots;  // <out>/plots/<name>.svg, in page order
  std::size_t n_steps = 0;                   // distinct steps read from metrics.jsonl
  std::vector<std::string> skipped_charts;   // chart names with no data in the metrics
  std::vector<std::string> warnings;         // optional inputs that could not be read
};

// Reads the run directory and writes the report. Throws NotFound (no run directory or no
// metrics.jsonl), InvalidInput (malformed or empty metrics.jsonl), Environment (write failures).
ReportResult write_report(const ReportOptions& options);
ReportResult write_report(const std::filesystem::path& run_dir,
                          const std::filesystem::path& out_dir = {});

// A chart of the report; `name` is the file stem under plots/.
struct NamedChart {
  std::string name;
  LineChart chart;
};
// The report's charts for a metrics log, in page order, including empty ones (chart.empty()).
std::vector<NamedChart> build_charts(const MetricsLog& log, const ReportOptions& options = {});

}  // namespace lorasync::report
