// Tests of lorasync_report: metrics.jsonl reading rules, chart maths and SVG robustness, and the
// files write_report produces (in temp directories).
#include "report/report.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "report/metrics_log.h"
#include "report/svg_chart.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::report {
namespace {

namespace fs = std::filesystem;

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
  ASSERT_TRUE(f.good()) << p;
}

std::size_t count(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t pos = hay.find(needle); pos != std::string::npos;
       pos = hay.find(needle, pos + needle.size()))
    ++n;
  return n;
}

// No NaN or infinity spelled anywhere a number could be (coordinates, tick labels, table cells).
void expect_no_non_finite(const std::string& text, const std::string& what) {
  EXPECT_EQ(text.find("nan"), std::string::npos) << what;
  EXPECT_EQ(text.find("NaN"), std::string::npos) << what;
  EXPECT_EQ(text.find("inf\""), std::string::npos) << what;
  EXPECT_EQ(text.find(">inf<"), std::string::npos) << what;
  EXPECT_EQ(text.find("Infinity"), std::string::npos) << what;
}

// A 50-step run with every charted key; weight syncs every 5 steps; one NaN entropy (as Python's
// json module writes it) and one step without ratio keys.
std::string synthetic_metrics(int n_steps) {
  std::string out;
  for (int s = 1; s <= n_steps; ++s) {
    double reward = 0.2 + 0.5 * s / n_steps + 0.1 * std::sin(s * 1.7);
    std::string line =
        "{\"step\": " + std::to_string(s) + ", \"time\": " + std::to_string(1700000000 + 3 * s) +
        ", \"version\": " + std::to_string(s / 5) + ", \"reward\": " + std::to_string(reward) +
        ", \"loss\": " + std::to_string(-0.01 * s) +
        ", \"completions/mean_length\": " + std::to_string(40 + s % 7) +
        ", \"completions/min_length\": 12, \"completions/max_length\": 96" +
        ", \"sample/staleness_mean\": " + std::to_string(0.5 + (s % 3) * 0.25) +
        ", \"sample/staleness_max\": " + std::to_string(1 + s % 2) +
        ", \"sample/rollout_queue_size\": " + std::to_string(s % 9) +
        ", \"perf/step_s\": " + std::to_string(2.5 + 0.1 * (s % 4)) +
        ", \"perf/rollout_wait_s\": 0.3, \"perf/tokens_per_s\": 1800.5" +
        ", \"rollout/generated_tok_s\": 950, \"note\": \"text is ignored\"";
    if (s != 17)
      line += ", \"ratio\": " + std::to_string(1.0 + 1e-4 * std::cos(s)) +
              ", \"ratio/min\": 0.97, \"ratio/max\": " + std::to_string(1.02 + 0.001 * s);
    line += s == 23 ? ", \"entropy\": NaN" : ", \"entropy\": " + std::to_string(1.5 - 0.01 * s);
    if (s % 5 == 0)
      line +=
          ", \"perf/weight_sync_s\": 0.8, \"perf/weight_sync_load_s\": 0.35, "
          "\"perf/weight_sync_save_s\": 0.2";
    line += "}\n";
    out += line;
    if (s == 10) out += "\n   \n";  // blank lines are skipped
  }
  return out;
}

TEST(MetricsLog, ReadsRowsAndSkipsBlankLines) {
  auto log = MetricsLog::parse(synthetic_metrics(50), "m.jsonl");
  EXPECT_EQ(log.n_steps(), 50u);
  EXPECT_EQ(log.steps().front(), 1);
  EXPECT_EQ(log.steps().back(), 50);
  EXPECT_TRUE(log.has("reward"));
  EXPECT_FALSE(log.has("note"));  // strings are not metrics
  EXPECT_EQ(log.points("perf/weight_sync_s").steps.size(), 10u);
  EXPECT_EQ(log.points("ratio").steps.size(), 49u);  // step 17 has none
  auto e = log.value(23, "entropy");
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE(std::isnan(*e));
}

TEST(MetricsLog, LaterLineForTheSameStepWins) {
  auto log = MetricsLog::parse(
      "{\"step\": 1, \"reward\": 0.1}\n"
      "{\"step\": 2, \"reward\": 0.2, \"loss\": 5}\n"
      "{\"step\": 3, \"reward\": 0.3}\n"
      "{\"step\": 2, \"reward\": 0.9}\n",
      "m.jsonl");
  EXPECT_EQ(log.n_steps(), 3u);
  EXPECT_EQ(log.value(2, "reward"), 0.9);
  EXPECT_FALSE(log.value(2, "loss").has_value());  // the whole row was replaced
  auto p = log.points("reward");
  ASSERT_EQ(p.steps.size(), 3u);
  EXPECT_EQ(p.steps[1], 2.0);
  EXPECT_EQ(p.values[1], 0.9);
}

TEST(MetricsLog, MalformedLineNamesFileAndLine) {
  try {
    MetricsLog::parse("{\"step\": 1, \"reward\": 0.1}\n\n{\"step\": 2, \"rew", "run/metrics.jsonl");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    std::string m = e.what();
    EXPECT_NE(m.find("run/metrics.jsonl"), std::string::npos) << m;
    EXPECT_NE(m.find("line 3"), std::string::npos) << m;
  }
  for (const char* bad :
       {"[1, 2]\n", "{\"reward\": 1}\n", "{\"step\": \"x\"}\n", "{\"step\": 1.5}\n"}) {
    try {
      MetricsLog::parse(std::string("{\"step\": 0}\n") + bad, "m.jsonl");
      FAIL() << "no error for " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
    }
  }
}

TEST(MetricsLog, EmptyAndMissingFiles) {
  TempDir dir("report-test");
  EXPECT_THROW(MetricsLog::parse("", "m.jsonl"), Error);
  EXPECT_THROW(MetricsLog::parse("\n  \n\n", "m.jsonl"), Error);
  try {
    MetricsLog::parse("\n", "empty.jsonl");
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("empty.jsonl"), std::string::npos);
  }
  try {
    MetricsLog::read(dir.path() / "metrics.jsonl");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
  }
}

TEST(SvgChart, NiceTicksAndLabels) {
  auto t = nice_ticks(0.13, 0.87, 5);
  ASSERT_GE(t.size(), 3u);
  EXPECT_LE(t.front(), 0.13);
  EXPECT_GE(t.back(), 0.87);
  EXPECT_TRUE(std::abs(t[1] - t[0] - 0.1) < 1e-12 || std::abs(t[1] - t[0] - 0.2) < 1e-12)
      << t[1] - t[0];
  EXPECT_LE(t.size(), 11u);
  auto xi = nice_ticks(1, 3, 6, true);  // integer axis: step >= 1
  EXPECT_NEAR(xi[1] - xi[0], 1.0, 1e-12);
  auto flat = nice_ticks(5, 5, 5);  // constant: padded, no division by zero
  EXPECT_LT(flat.front(), 5);
  EXPECT_GT(flat.back(), 5);
  auto zero = nice_ticks(0, 0, 5);
  EXPECT_LT(zero.front(), 0);
  EXPECT_GT(zero.back(), 0);
  auto tiny = nice_ticks(0.99995, 1.00005, 5);
  EXPECT_GE(tiny.size(), 3u);
  EXPECT_EQ(format_tick(0.2, 0.2), "0.2");
  EXPECT_EQ(format_tick(1.0, 0.00002), "1.00000");
  EXPECT_EQ(format_tick(-1e-17, 0.1), "0.0");
  EXPECT_EQ(format_tick(12000, 2000), "12k");
  EXPECT_EQ(format_tick(30, 10), "30");
  EXPECT_EQ(xml_escape("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
}

TEST(SvgChart, MovingAverageSkipsNonFinite) {
  double nan = std::numeric_limits<double>::quiet_NaN();
  auto m = moving_average({1, 2, nan, 3, 4}, 2);
  EXPECT_EQ(m[0], 1.0);
  EXPECT_EQ(m[1], 1.5);
  EXPECT_TRUE(std::isnan(m[2]));
  EXPECT_EQ(m[3], 2.5);
  EXPECT_EQ(m[4], 3.5);
}

TEST(SvgChart, SinglePointConstantAndNonFiniteSeries) {
  double nan = std::numeric_limits<double>::quiet_NaN();
  double inf = std::numeric_limits<double>::infinity();
  LineChart one({.title = "one"});
  one.add_series({"x", {7}, {0.5}});
  std::string s1 = one.to_svg();
  EXPECT_NE(s1.find("<circle"), std::string::npos);  // a lone point is visible
  expect_no_non_finite(s1, "single point");

  LineChart flat({.title = "flat", .y_include_zero = true});
  flat.add_series({"zeros", {1, 2, 3}, {0, 0, 0}});
  flat.add_series({"bad", {1, 2, 3, 4}, {nan, inf, -inf, nan}});
  flat.add_band({"band", {1, 2}, {0, nan}, {0, 1}});
  std::string s2 = flat.to_svg();
  EXPECT_NE(s2.find("<polyline"), std::string::npos);
  expect_no_non_finite(s2, "constant");
  EXPECT_EQ(s2.find(">-1<"), std::string::npos);  // all-zero counts: axis from 0, not -1

  LineChart none({.title = "nothing"});
  none.add_series({"bad", {1}, {nan}});
  EXPECT_TRUE(none.empty());
  std::string s3 = none.to_svg();
  EXPECT_NE(s3.find("no data"), std::string::npos);
  expect_no_non_finite(s3, "empty");

  LineChart ratio({.title = "ratio"});
  ratio.add_series({"mean", {1, 2, 3}, {0.2, 0.3, 0.25}});
  ratio.add_reference(1.0, "1.0");
  std::string s4 = ratio.to_svg();
  EXPECT_NE(s4.find(">1.0<"), std::string::npos) << "the reference is inside the y range";
}

TEST(Report, WritesHtmlAndPlotsForASyntheticRun) {
  TempDir dir("report-test");
  write_text(dir.path() / "metrics.jsonl", synthetic_metrics(50));
  write_text(dir.path() / "run.json",
             R"({"run_name": "demo <run> & co", "start_time": 1700000000, "restarts": 0})");
  write_text(dir.path() / "summary.json",
             R"js({"rows": [{"name": "reward, first 10 steps", "value": 0.31},
                            {"name": "reward, last 10 steps", "value": 0.72},
                            {"name": "held-out accuracy (trained)", "value": "0.58"}]})js");
  write_text(dir.path() / "eval.json",
             R"({"base": {"accuracy": 0.21, "n": 200}, "trained": {"accuracy": 0.58, "n": 200}})");

  ReportResult r = write_report(dir.path());
  EXPECT_EQ(r.n_steps, 50u);
  EXPECT_EQ(r.html, dir.path() / "report.html");
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_TRUE(r.skipped_charts.empty());
  ASSERT_EQ(r.plots.size(), 10u);
  const std::string html = read_file(r.html);

  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(count(html, "<svg"), r.plots.size());
  EXPECT_EQ(count(html, "</svg>"), r.plots.size());
  EXPECT_EQ(count(html, "<figure"), count(html, "</figure>"));
  EXPECT_EQ(count(html, "<table"), count(html, "</table>"));
  EXPECT_EQ(count(html, "<section"), count(html, "</section>"));
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(count(html, "src=\""), 0u);  // no external resources
  expect_no_non_finite(html, "report.html");
  // The run label is shown, escaped.
  EXPECT_NE(html.find("demo &lt;run&gt; &amp; co"), std::string::npos);
  EXPECT_EQ(html.find("demo <run>"), std::string::npos);
  // Summary, evaluation and the overview table.
  EXPECT_NE(html.find("reward, last 10 steps"), std::string::npos);
  EXPECT_NE(html.find("0.72"), std::string::npos);
  EXPECT_NE(html.find("<th>accuracy</th>"), std::string::npos);
  EXPECT_NE(html.find("trained"), std::string::npos);
  EXPECT_NE(html.find("<th>sample/staleness_max</th>"), std::string::npos);

  for (const char* name : {"reward", "ratio", "staleness", "rollout_queue", "step_time",
                           "weight_sync", "loss", "entropy", "completion_length", "throughput"}) {
    fs::path p = dir.path() / "plots" / (std::string(name) + ".svg");
    ASSERT_TRUE(fs::exists(p)) << p;
    std::string svg = read_file(p);
    EXPECT_EQ(svg.rfind("<svg xmlns=", 0), 0u) << name;
    EXPECT_EQ(count(svg, "<svg"), 1u) << name;
    EXPECT_EQ(count(svg, "</svg>"), 1u) << name;
    EXPECT_NE(svg.find("<polyline"), std::string::npos) << name;
    expect_no_non_finite(svg, name);
    EXPECT_NE(html.find(svg), std::string::npos) << name << ": the page inlines the same SVG";
  }
  EXPECT_NE(read_file(dir.path() / "plots" / "reward.svg").find("moving average"),
            std::string::npos);
  EXPECT_NE(read_file(dir.path() / "plots" / "ratio.svg").find("<polygon"), std::string::npos);
}

TEST(Report, MissingKeysLeaveChartsOutAndOutDirIsHonoured) {
  TempDir dir("report-test");
  write_text(dir.path() / "metrics.jsonl",
             "{\"step\": 0, \"reward\": 0.5}\n"
             "{\"step\": 1}\n"
             "{\"step\": 2, \"reward\": 0.5, \"perf/step_s\": 1.25}\n"
             "{\"step\": 3, \"reward\": null, \"sample/rollout_queue_size\": 0}\n");
  write_text(dir.path() / "summary.json", "{not json");
  // The shape `lorasync eval --out` writes: a flat object, key order kept, null shown as a dash.
  write_text(
      dir.path() / "eval.json",
      "{\"accuracy\": 0.5, \"problems\": 20, \"adapter\": null, \"mode\": \"in_process\"}\n");
  fs::path out = dir.path() / "out" / "nested";
  ReportResult r = write_report(dir.path(), out);
  EXPECT_EQ(r.n_steps, 4u);
  EXPECT_EQ(r.html, out / "report.html");
  EXPECT_TRUE(fs::exists(out / "report.html"));
  EXPECT_FALSE(fs::exists(dir.path() / "report.html"));
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("summary.json"), std::string::npos);
  // reward (constant), step time (single point) and queue (all zeros) are drawn; the rest not.
  ASSERT_EQ(r.plots.size(), 3u);
  EXPECT_TRUE(fs::exists(out / "plots" / "reward.svg"));
  EXPECT_TRUE(fs::exists(out / "plots" / "step_time.svg"));
  EXPECT_TRUE(fs::exists(out / "plots" / "rollout_queue.svg"));
  EXPECT_FALSE(fs::exists(out / "plots" / "ratio.svg"));
  EXPECT_NE(std::find(r.skipped_charts.begin(), r.skipped_charts.end(), "ratio"),
            r.skipped_charts.end());
  std::string html = read_file(r.html);
  EXPECT_EQ(count(html, "<svg"), 3u);
  EXPECT_NE(html.find("Not plotted"), std::string::npos);
  EXPECT_NE(html.find("class=\"warn\""), std::string::npos);
  expect_no_non_finite(html, "sparse report.html");
  auto acc = html.find("<th>accuracy</th>");
  ASSERT_NE(acc, std::string::npos);
  EXPECT_LT(acc, html.find("<th>problems</th>"));
  EXPECT_LT(html.find("<th>problems</th>"), html.find("<th>adapter</th>"));
  EXPECT_NE(html.find("<th>adapter</th><td>&mdash;</td>"), std::string::npos);
}

TEST(Report, ErrorsOnMissingEmptyOrMalformedMetrics) {
  TempDir dir("report-test");
  EXPECT_THROW(write_report(dir.path() / "nope"), Error);
  try {
    write_report(dir.path());
    FAIL() << "no error without metrics.jsonl";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl"), std::string::npos);
  }
  write_text(dir.path() / "metrics.jsonl", "");
  EXPECT_THROW(write_report(dir.path()), Error);
  write_text(dir.path() / "metrics.jsonl", "{\"step\": 1}\n{\"step\": 2,,}\n");
  try {
    write_report(dir.path());
    FAIL() << "no error on a malformed line";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.path() / "report.html"));
}

}  // namespace
}  // namespace lorasync::report
