// `lorasync report RUN_DIR [--out DIR]`: the HTML report of a training run.
//
// Reads RUN_DIR/metrics.jsonl (and run.json, summary.json, eval.json when present) and writes
// DIR/report.html plus DIR/plots/<chart>.svg (DIR defaults to RUN_DIR); see report/report.h.
// Output: one JSON line on stdout, {"report": path, "steps": N, "plots": [paths...]}; warnings
// about optional inputs on stderr.
// Exit status: 0 written; 1 on any failure (no run directory, missing, empty or malformed
// metrics.jsonl, write errors), with the message (file and line number) on stderr.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "report/report.h"
#include "util/error.h"

namespace lorasync::cli {
namespace {

struct ReportCmdOptions {
  std::string run_dir;  // trainer output directory holding metrics.jsonl
  std::string out;      // output directory; empty = run_dir
  int window = 0;       // reward moving-average window in steps; 0 = automatic
};

int run(const ReportCmdOptions& o) {
  report::ReportOptions ro;
  ro.run_dir = o.run_dir;
  ro.out_dir = o.out;
  ro.moving_average_window = o.window;
  report::ReportResult r;
  try {
    r = report::write_report(ro);
  } catch (const Error& e) {
    std::fprintf(stderr, "lorasync report: error: %s\n", e.what());
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    std::fprintf(stderr, "lorasync report: error: %s\n", e.what());
    return 1;
  }
  for (const auto& w : r.warnings)
    std::fprintf(stderr, "lorasync report: warning: %s\n", w.c_str());
  nlohmann::ordered_json plots = nlohmann::ordered_json::array();
  for (const auto& p : r.plots) plots.push_back(p.string());
  nlohmann::ordered_json line = {
      {"report", r.html.string()}, {"steps", r.n_steps}, {"plots", plots}};
  if (!r.skipped_charts.empty()) line["skipped"] = r.skipped_charts;
  std::printf("%s\n",
              line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
  return 0;
}

}  // namespace

void register_report(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<ReportCmdOptions>();
  auto* sub = root.add_subcommand(
      "report", "write report.html and SVG plots of a training run from its metrics.jsonl");
  sub->add_option("run_dir", o->run_dir, "run directory (the trainer's output_dir)")->required();
  sub->add_option("--out", o->out, "output directory (default: the run directory)");
  sub->add_option("--window", o->window, "reward moving-average window in steps (0 = automatic)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
