// report/report.cpp: chart selection, the HTML page, and the writes.
//
// The page is plain HTML with one inline <style> block and inline SVG charts; everything the page
// shows is escaped (run labels and summary values come from files a user may edit). Files under
// plots/ are written first and report.html last, each atomically, so a report.html on disk always
// refers to complete plot files.
#include "report/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "util/error.h"
#include "util/files.h"

namespace lorasync::report {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;  // keeps the key order of summary and eval files

namespace {

// ---- charts -------------------------------------------------------------------------------------

constexpr const char* kBlue = "#2563eb";
constexpr const char* kLightBlue = "#93c5fd";
constexpr const char* kRed = "#dc2626";
constexpr const char* kGreen = "#16a34a";
constexpr const char* kOrange = "#ea580c";
constexpr const char* kPurple = "#7c3aed";
constexpr const char* kCyan = "#0891b2";

ChartOptions chart_options(const ReportOptions& ro, std::string title, std::string y_label,
                           bool include_zero) {
  ChartOptions o;
  o.title = std::move(title);
  o.y_label = std::move(y_label);
  o.y_include_zero = include_zero;
  o.width = ro.chart_width;
  o.height = ro.chart_height;
  return o;
}

// Adds `key` as a series when the log has it; returns whether it did.
bool add_metric(LineChart& chart, const MetricsLog& log, const std::string& key,
                const std::string& label, const std::string& color, bool dashed = false,
                double width = 1.8) {
  auto p = log.points(key);
  if (p.empty()) return false;
  Series s;
  s.name = label;
  s.x = std::move(p.steps);
  s.y = std::move(p.values);
  s.color = color;
  s.dashed = dashed;
  s.stroke_width = width;
  chart.add_series(std::move(s));
  return true;
}

// A min..max band from two keys at the steps where both are present; falls back to dashed lines
// for whichever key exists alone.
void add_band_or_lines(LineChart& chart, const MetricsLog& log, const std::string& lo_key,
                       const std::string& hi_key, const std::string& label,
                       const std::string& color) {
  auto pp = log.pair_points(lo_key, hi_key);
  if (!pp.steps.empty()) {
    chart.add_band({label, std::move(pp.steps), std::move(pp.a), std::move(pp.b), color});
    return;
  }
  add_metric(chart, log, lo_key, lo_key, color, true, 1.2);
  add_metric(chart, log, hi_key, hi_key, color, true, 1.2);
}

int auto_window(std::size_t n_points) {
  return std::clamp(static_cast<int>(std::lround(static_cast<double>(n_points) / 10.0)), 3, 25);
}

// ---- formatting ---------------------------------------------------------------------------------

std::string esc(std::string_view s) {
  return xml_escape(s);
}

std::string format_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (std::floor(v) == v && std::abs(v) < 1e15) return fmt::format("{}", static_cast<long long>(v));
  return fmt::format("{:.6g}", v);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "";
  if (seconds < 60) return fmt::format("{:.1f} s", seconds);
  auto total = static_cast<long long>(std::lround(seconds));
  long long h = total / 3600, m = (total % 3600) / 60, s = total % 60;
  if (h > 0) return fmt::format("{}h {:02}m {:02}s", h, m, s);
  return fmt::format("{}m {:02}s", m, s);
}

std::string utc_date(double unix_seconds) {
  auto t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string utc_now() {
  return utc_date(static_cast<double>(std::time(nullptr)));
}

// A JSON value as table-cell text (already escaped).
std::string cell(const json& v) {
  if (v.is_string()) return esc(v.get_ref<const std::string&>());
  if (v.is_number()) return esc(format_number(v.get<double>()));
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_null()) return "&mdash;";
  if (v.is_array() &&
      std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_primitive(); })) {
    std::string out;
    for (const auto& e : v) out += (out.empty() ? "" : ", ") + cell(e);
    return out;
  }
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 240) s = s.substr(0, 237) + "...";
  return "<code>" + esc(s) + "</code>";
}

// Flattens nested objects into "a.b" keys (arrays and scalars are leaves).
void flatten(const json& obj, const std::string& prefix,
             std::vector<std::pair<std::string, const json*>>& out) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object() && !it->empty())
      flatten(*it, key, out);
    else
      out.emplace_back(key, &*it);
  }
}

// A table from objects (rows), columns in first-seen order; `first` columns go first if present.
std::string rows_table(const json& rows, const std::vector<std::string>& first) {
  std::vector<std::string> cols;
  auto add_col = [&](const std::string& c) {
    if (std::find(cols.begin(), cols.end(), c) == cols.end()) cols.push_back(c);
  };
  for (const auto& f : first)
    for (const auto& r : rows)
      if (r.is_object() && r.contains(f)) {
        add_col(f);
        break;
      }
  for (const auto& r : rows)
    if (r.is_object())
      for (auto it = r.begin(); it != r.end(); ++it) add_col(it.key());
  std::string out = "<table class=\"data\">\n<thead><tr>";
  for (const auto& c : cols) out += "<th>" + esc(c) + "</th>";
  out += "</tr></thead>\n<tbody>\n";
  for (const auto& r : rows) {
    out += "<tr>";
    if (!r.is_object()) {
      out +=
          fmt::format("<td colspan=\"{}\">{}</td>", std::max<std::size_t>(1, cols.size()), cell(r));
    } else {
      for (const auto& c : cols) out += "<td>" + (r.contains(c) ? cell(r[c]) : "") + "</td>";
    }
    out += "</tr>\n";
  }
  return out + "</tbody>\n</table>\n";
}

std::string key_value_table(const std::vector<std::pair<std::string, const json*>>& kv) {
  std::string out = "<table class=\"kv\">\n<tbody>\n";
  for (const auto& [k, v] : kv)
    out += "<tr><th>" + esc(k) + "</th><td>" + cell(*v) + "</td></tr>\n";
  return out + "</tbody>\n</table>\n";
}

// An object whose values are all objects of scalars ({"base": {...}, "trained": {...}}).
bool is_record_map(const json& j) {
  if (!j.is_object() || j.empty()) return false;
  for (const auto& v : j) {
    if (!v.is_object() || v.empty()) return false;
    for (const auto& e : v)
      if (!e.is_primitive()) return false;
  }
  return true;
}

// Whatever JSON a summary or eval file holds, as HTML tables.
std::string json_tables(const json& j) {
  if (j.is_object() && j.contains("rows") && j["rows"].is_array()) {
    std::string out = rows_table(j["rows"], {"name", "value"});
    std::vector<std::pair<std::string, const json*>> rest;
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "rows") rest.emplace_back(it.key(), &*it);
    if (!rest.empty()) out += key_value_table(rest);
    return out;
  }
  if (is_record_map(j)) {
    json rows = json::array();
    for (auto it = j.begin(); it != j.end(); ++it) {
      json r = {{"", it.key()}};
      r.update(*it);
      rows.push_back(std::move(r));
    }
    return rows_table(rows, {""});
  }
  if (j.is_object()) {
    std::vector<std::pair<std::string, const json*>> kv;
    flatten(j, "", kv);
    return key_value_table(kv);
  }
  if (j.is_array() && !j.empty() && j[0].is_object()) return rows_table(j, {"name", "value"});
  return "<pre>" + esc(j.dump(2, ' ', false, json::error_handler_t::replace)) + "</pre>\n";
}

// ---- inputs -------------------------------------------------------------------------------------

// An optional JSON file: nullopt when absent; a warning when unreadable or malformed.
std::optional<json> read_optional_json(const fs::path& path, std::vector<std::string>& warnings) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  try {
    return json::parse(read_file(path));
  } catch (const json::exception& e) {
    warnings.push_back(fmt::format("{}: malformed JSON ({}); not shown", path.string(), e.what()));
  } catch (const std::exception& e) {
    warnings.push_back(fmt::format("{}: cannot read ({}); not shown", path.string(), e.what()));
  }
  return std::nullopt;
}

std::string run_label(const json& run) {
  if (!run.is_object()) return "";
  for (const char* k : {"run_name", "run_label", "label", "name"})
    if (auto it = run.find(k); it != run.end() && it->is_string()) return it->get<std::string>();
  return "";
}

// Metrics summarised in the overview table, in order (only those present are shown).
constexpr const char* kOverviewKeys[] = {
    "reward",
    "reward_std",
    "ratio",
    "ratio/min",
    "ratio/max",
    "mismatch/kl",
    "loss",
    "entropy",
    "grad_norm",
    "kl",
    "completions/mean_length",
    "completions/clipped_ratio",
    "sample/staleness_mean",
    "sample/staleness_max",
    "sample/rollout_queue_size",
    "perf/step_s",
    "perf/rollout_wait_s",
    "perf/weight_sync_s",
    "perf/weight_sync_load_s",
    "perf/tokens_per_s",
    "rollout/generated_tok_s",
};

std::string overview_table(const MetricsLog& log) {
  std::string out =
      "<table>\n<thead><tr><th>metric</th><th>points</th><th>first</th><th>last</th><th>min</th>"
      "<th>max</th><th>mean</th><th>mean, first 10</th><th>mean, last 10</th></tr></thead>\n"
      "<tbody>\n";
  bool any = false;
  for (const char* key : kOverviewKeys) {
    auto st = series_stats(log.points(key).values, 10);
    if (!st) continue;
    any = true;
    out += fmt::format(
        "<tr><th>{}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td></tr>\n",
        esc(key), st->n, format_number(st->first), format_number(st->last), format_number(st->min),
        format_number(st->max), format_number(st->mean), format_number(st->mean_first),
        format_number(st->mean_last));
  }
  if (!any) return "";
  return out + "</tbody>\n</table>\n";
}

constexpr const char* kCss = R"css(
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #f3f4f6; color: #111827;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1200px; margin: 0 auto; padding: 24px 20px 48px; }
header h1 { font-size: 24px; margin: 0; font-weight: 650; }
header .label { font-size: 16px; color: #2563eb; margin-top: 2px; font-weight: 550; }
.meta { display: flex; flex-wrap: wrap; gap: 6px 22px; margin: 12px 0 0; padding: 0; color: #4b5563;
  font-size: 13px; }
.meta div { display: flex; gap: 6px; }
.meta dt { color: #6b7280; }
.meta dd { margin: 0; font-weight: 550; color: #111827; }
section.card { background: #fff; border: 1px solid #e5e7eb; border-radius: 10px; padding: 14px 18px;
  margin-top: 18px; }
section.card h2 { font-size: 16px; margin: 0 0 10px; font-weight: 620; }
h2.plots { font-size: 16px; margin: 26px 0 10px; font-weight: 620; }
table { border-collapse: collapse; width: 100%; font-size: 13px; font-variant-numeric: tabular-nums; }
th, td { padding: 5px 10px; border-bottom: 1px solid #f0f1f3; text-align: right; white-space: nowrap; }
thead th { color: #6b7280; font-weight: 600; border-bottom: 1px solid #e5e7eb; }
tbody th, td:first-child, thead th:first-child { text-align: left; }
tbody th { font-weight: 550; color: #374151; }
table.kv, table.data { width: auto; min-width: 50%; }
table.kv td { text-align: left; }
tbody tr:last-child th, tbody tr:last-child td { border-bottom: none; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 16px; }
figure.chart { margin: 0; background: #fff; border: 1px solid #e5e7eb; border-radius: 10px;
  padding: 10px 10px 4px; }
figure.chart svg { display: block; width: 100%; height: auto; }
figure.chart figcaption { text-align: right; font-size: 11px; padding: 0 6px 4px; }
a { color: #2563eb; text-decoration: none; }
.note { color: #6b7280; font-size: 13px; margin-top: 10px; }
.warn { background: #fffbeb; border: 1px solid #fde68a; color: #92400e; border-radius: 8px;
  padding: 8px 12px; margin-top: 14px; font-size: 13px; }
code { font-size: 12px; }
footer { color: #9ca3af; font-size: 12px; margin-top: 28px; }
)css";

}  // namespace

std::vector<NamedChart> build_charts(const MetricsLog& log, const ReportOptions& ro) {
  std::vector<NamedChart> charts;

  {  // reward: raw points thin and light, the moving average bold.
    LineChart c(chart_options(ro, "Reward", "mean reward", false));
    auto p = log.points("reward");
    std::size_t n_finite = 0;
    for (double v : p.values) n_finite += std::isfinite(v) ? 1 : 0;
    if (!p.empty()) {
      bool smooth = n_finite >= 4;
      int w = ro.moving_average_window > 0 ? ro.moving_average_window : auto_window(n_finite);
      Series raw{"reward", p.steps, p.values, smooth ? kLightBlue : kBlue, smooth ? 1.3 : 1.8};
      c.add_series(std::move(raw));
      if (smooth)
        c.add_series({fmt::format("moving average ({} steps)", w), p.steps,
                      moving_average(p.values, w), kBlue, 2.4, false, Markers::kNever});
    }
    charts.push_back({"reward", std::move(c)});
  }
  {  // ratio: min..max band, mean, and the 1.0 it should hug.
    LineChart c(chart_options(ro, "Importance ratio (trainer / sampler)", "ratio", false));
    add_band_or_lines(c, log, "ratio/min", "ratio/max", "min .. max", kPurple);
    add_metric(c, log, "ratio", "mean", kPurple, false, 2.0);
    if (!c.empty()) c.add_reference(1.0, "1.0");
    charts.push_back({"ratio", std::move(c)});
  }
  {
    LineChart c(chart_options(ro, "Sample staleness", "syncs", true));
    add_metric(c, log, "sample/staleness_mean", "mean", kGreen, false, 2.0);
    add_metric(c, log, "sample/staleness_max", "max", kOrange, true, 1.5);
    charts.push_back({"staleness", std::move(c)});
  }
  {
    LineChart c(chart_options(ro, "Rollout queue size", "samples", true));
    add_metric(c, log, "sample/rollout_queue_size", "queued samples", kCyan, false, 2.0);
    charts.push_back({"rollout_queue", std::move(c)});
  }
  {
    LineChart c(chart_options(ro, "Step time", "seconds", true));
    add_metric(c, log, "perf/step_s", "step", kBlue, false, 2.0);
    add_metric(c, log, "perf/rollout_wait_s", "waiting for rollouts", kOrange, true, 1.5);
    charts.push_back({"step_time", std::move(c)});
  }
  {
    LineChart c(chart_options(ro, "Weight sync time", "seconds", true));
    add_metric(c, log, "perf/weight_sync_s", "total", kRed, false, 2.0);
    add_metric(c, log, "perf/weight_sync_save_s", "save", kGreen, true, 1.4);
    add_metric(c, log, "perf/weight_sync_publish_s", "publish", kCyan, true, 1.4);
    add_metric(c, log, "perf/weight_sync_load_s", "load on replicas", kPurple, false, 1.6);
    charts.push_back({"weight_sync", std::move(c)});
  }
  {
    LineChart c(chart_options(ro, "Loss", "J", false));
    add_metric(c, log, "loss", "loss", kBlue);
    charts.push_back({"loss", std::move(c)});
  }
  {
    LineChart c(chart_options(ro, "Token entropy", "nats", false));
    add_metric(c, log, "entropy", "entropy", kGreen);
    charts.push_back({"entropy", std::move(c)});
  }
  {
    LineChart c(chart_options(ro, "Completion length", "tokens", true));
    add_band_or_lines(c, log, "completions/min_length", "completions/max_length", "min .. max",
                      kOrange);
    add_metric(c, log, "completions/mean_length", "mean", kOrange, false, 2.0);
    charts.push_back({"completion_length", std::move(c)});
  }
  {
    LineChart c(chart_options(ro, "Throughput", "tokens / s", true));
    add_metric(c, log, "perf/tokens_per_s", "trainer (forwarded)", kBlue, false, 2.0);
    add_metric(c, log, "rollout/generated_tok_s", "rollouts (generated)", kGreen, false, 2.0);
    charts.push_back({"throughput", std::move(c)});
  }
  return charts;
}

ReportResult write_report(const fs::path& run_dir, const fs::path& out_dir) {
  ReportOptions o;
  o.run_dir = run_dir;
  o.out_dir = out_dir;
  return write_report(o);
}

ReportResult write_report(const ReportOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(options.run_dir, ec))
    throw_not_found("run directory '{}' does not exist", options.run_dir.string());
  const fs::path metrics_path = options.run_dir / "metrics.jsonl";
  if (!fs::exists(metrics_path, ec))
    throw_not_found("no metrics.jsonl in run directory '{}'", options.run_dir.string());
  const MetricsLog log = MetricsLog::read(metrics_path);

  ReportResult result;
  result.n_steps = log.n_steps();
  const fs::path out = options.out_dir.empty() ? options.run_dir : options.out_dir;
  const fs::path plots_dir = out / "plots";
  fs::create_directories(plots_dir, ec);
  if (ec) throw_env("cannot create '{}': {}", plots_dir.string(), ec.message());

  auto run = read_optional_json(options.run_dir / "run.json", result.warnings);
  auto summary = read_optional_json(options.run_dir / "summary.json", result.warnings);
  auto eval = read_optional_json(options.run_dir / "eval.json", result.warnings);

  // Charts first: each SVG file, then the page that inlines the same text.
  std::string figures;
  for (auto& [name, chart] : build_charts(log, options)) {
    if (chart.empty()) {
      result.skipped_charts.push_back(name);
      continue;
    }
    std::string svg = chart.to_svg();
    fs::path file = plots_dir / (name + ".svg");
    write_file_atomic(file, svg);
    result.plots.push_back(file);
    figures += fmt::format(
        "<figure class=\"chart\" id=\"{0}\">\n{1}<figcaption><a href=\"plots/{0}.svg\">{0}.svg"
        "</a></figcaption>\n</figure>\n",
        name, svg);
  }

  // Header facts.
  const std::string label = run ? run_label(*run) : "";
  const auto steps = log.steps();
  std::vector<std::pair<std::string, std::string>> meta;
  fs::path shown_dir = fs::weakly_canonical(options.run_dir, ec);
  meta.emplace_back("run directory", (ec ? options.run_dir : shown_dir).string());
  meta.emplace_back(
      "steps", steps.front() == steps.back()
                   ? fmt::format("{} (step {})", steps.size(), steps.front())
                   : fmt::format("{} (step {} to {})", steps.size(), steps.front(), steps.back()));
  if (auto t = log.points("time"); t.steps.size() >= 2) {
    auto st = series_stats(t.values);
    if (st && st->max > st->min)
      meta.emplace_back("logged over", format_duration(st->max - st->min));
  }
  if (auto v = log.value(steps.back(), "version"))
    meta.emplace_back("last version", format_number(*v));
  if (auto r = log.points("restarts"); !r.empty()) {
    auto st = series_stats(r.values);
    if (st && st->max > 0) meta.emplace_back("restarts", format_number(st->max));
  }
  if (run && run->is_object()) {
    for (auto it = run->begin(); it != run->end(); ++it) {
      const std::string& k = it.key();
      if (k == "run_name" || k == "run_label" || k == "label" || k == "name") continue;
      if (!it->is_primitive() || it->is_null()) continue;
      // Unix times ("start_time", "created_at") as dates; other values as written.
      bool is_time = k.ends_with("time") || k.ends_with("_at");
      if (is_time && it->is_number() && it->get<double>() > 1e8)
        meta.emplace_back(k, utc_date(it->get<double>()));
      else
        meta.emplace_back(k, it->is_string() ? it->get<std::string>() : it->dump());
    }
  }

  std::string html;
  html.reserve(64 * 1024 + figures.size());
  const std::string page_title = label.empty() ? options.title : options.title + " - " + label;
  html += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  html += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  html += fmt::format("<title>{}</title>\n<style>{}</style>\n</head>\n<body>\n<main>\n",
                      esc(page_title), kCss);
  html += fmt::format("<header>\n<h1>{}</h1>\n", esc(options.title));
  if (!label.empty()) html += fmt::format("<div class=\"label\">{}</div>\n", esc(label));
  html += "<dl class=\"meta\">\n";
  for (const auto& [k, v] : meta)
    html += fmt::format("<div><dt>{}</dt><dd>{}</dd></div>\n", esc(k), esc(v));
  html += "</dl>\n</header>\n";
  for (const auto& w : result.warnings)
    html += fmt::format("<div class=\"warn\">{}</div>\n", esc(w));

  if (summary)
    html += fmt::format("<section class=\"card\" id=\"summary\">\n<h2>Summary</h2>\n{}</section>\n",
                        json_tables(*summary));
  if (eval)
    html += fmt::format("<section class=\"card\" id=\"eval\">\n<h2>Evaluation</h2>\n{}</section>\n",
                        json_tables(*eval));
  if (std::string t = overview_table(log); !t.empty())
    html += fmt::format(
        "<section class=\"card\" id=\"metrics\">\n<h2>Metrics over the run</h2>\n{}</section>\n",
        t);

  html += "<h2 class=\"plots\">Plots</h2>\n<div class=\"charts\">\n" + figures + "</div>\n";
  if (!result.skipped_charts.empty()) {
    std::string names;
    for (const auto& n : result.skipped_charts) names += (names.empty() ? "" : ", ") + n;
    html += fmt::format("<p class=\"note\">Not plotted (no values in metrics.jsonl): {}.</p>\n",
                        esc(names));
  }
  html += fmt::format("<footer>Generated by lorasync {} on {}.</footer>\n", esc(LORASYNC_VERSION),
                      esc(utc_now()));
  html += "</main>\n</body>\n</html>\n";

  result.html = out / "report.html";
  write_file_atomic(result.html, html);
  return result;
}

}  // namespace lorasync::report
