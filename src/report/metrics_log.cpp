// report/metrics_log.cpp: JSONL parsing of metrics.jsonl into step-keyed rows.
#include "report/metrics_log.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "util/error.h"
#include "util/files.h"

namespace lorasync::report {
namespace {

// Quotes the bare NaN / Infinity / -Infinity tokens that Python's json module writes outside
// strings, so that strict JSON parsing accepts the line; numeric_value() maps them back.
std::string quote_non_finite_tokens(std::string_view line) {
  std::string out;
  out.reserve(line.size() + 16);
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (in_string) {
      out.push_back(c);
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      out.push_back(c);
      continue;
    }
    bool matched = false;
    for (std::string_view tok : {"-Infinity", "Infinity", "NaN"}) {
      if (line.substr(i, tok.size()) == tok) {
        out += '"';
        out += tok;
        out += '"';
        i += tok.size() - 1;
        matched = true;
        break;
      }
    }
    if (!matched) out.push_back(c);
  }
  return out;
}

std::optional<double> numeric_value(const nlohmann::json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
    if (s == "Infinity") return std::numeric_limits<double>::infinity();
    if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
  }
  return std::nullopt;
}

// nlohmann's messages start with "[json.exception.parse_error.101] "; the tag helps nobody.
std::string short_json_error(const char* what) {
  std::string s = what;
  if (!s.empty() && s.front() == '[') {
    auto close = s.find("] ");
    if (close != std::string::npos) s.erase(0, close + 2);
  }
  // Each line is parsed alone, so "line 1" would contradict the file line we report.
  if (auto at = s.find("at line 1, column"); at != std::string::npos) s.erase(at + 3, 8);
  return s;
}

}  // namespace

MetricsLog MetricsLog::read(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw_not_found("metrics file '{}' does not exist", path.string());
  return parse(read_file(path), path.string());
}

MetricsLog MetricsLog::parse(std::string_view text, const std::string& source) {
  MetricsLog log;
  std::size_t line_no = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;

    nlohmann::json row;
    try {
      row = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& first_error) {
      try {
        row = nlohmann::json::parse(quote_non_finite_tokens(line));
      } catch (const nlohmann::json::exception&) {
        throw_invalid("{}: line {}: malformed JSON: {}", source, line_no,
                      short_json_error(first_error.what()));
      }
    }
    if (!row.is_object())
      throw_invalid("{}: line {}: expected a JSON object, got {}", source, line_no,
                    row.type_name());
    auto step_it = row.find("step");
    if (step_it == row.end())
      throw_invalid("{}: line {}: missing integer field 'step'", source, line_no);
    long long step = 0;
    if (step_it->is_number_integer()) {
      step = step_it->get<long long>();
    } else if (step_it->is_number_float() && std::isfinite(step_it->get<double>()) &&
               std::floor(step_it->get<double>()) == step_it->get<double>() &&
               std::abs(step_it->get<double>()) < 9e15) {
      step = static_cast<long long>(step_it->get<double>());
    } else {
      throw_invalid("{}: line {}: 'step' must be an integer, got {}", source, line_no,
                    step_it->dump());
    }
    Row values;
    for (auto it = row.begin(); it != row.end(); ++it) {
      if (it.key() == "step") continue;
      if (auto v = numeric_value(it.value())) values.emplace(it.key(), *v);
    }
    log.rows_[step] = std::move(values);  // a later line for the same step wins
  }
  if (log.rows_.empty()) throw_invalid("{}: no metrics rows (the file is empty)", source);
  return log;
}

std::vector<long long> MetricsLog::steps() const {
  std::vector<long long> out;
  out.reserve(rows_.size());
  for (const auto& [step, row] : rows_) out.push_back(step);
  return out;
}

std::vector<std::string> MetricsLog::keys() const {
  std::set<std::string> all;
  for (const auto& [step, row] : rows_)
    for (const auto& [key, v] : row) all.insert(key);
  return {all.begin(), all.end()};
}

bool MetricsLog::has(std::string_view key) const {
  for (const auto& [step, row] : rows_)
    if (row.find(key) != row.end()) return true;
  return false;
}

MetricsLog::Points MetricsLog::points(std::string_view key) const {
  Points p;
  for (const auto& [step, row] : rows_) {
    auto it = row.find(key);
    if (it == row.end()) continue;
    p.steps.push_back(static_cast<double>(step));
    p.values.push_back(it->second);
  }
  return p;
}

MetricsLog::PairPoints MetricsLog::pair_points(std::string_view key_a,
                                               std::string_view key_b) const {
  PairPoints p;
  for (const auto& [step, row] : rows_) {
    auto a = row.find(key_a);
    auto b = row.find(key_b);
    if (a == row.end() || b == row.end()) continue;
    p.steps.push_back(static_cast<double>(step));
    p.a.push_back(a->second);
    p.b.push_back(b->second);
  }
  return p;
}

std::optional<double> MetricsLog::value(long long step, std::string_view key) const {
  auto r = rows_.find(step);
  if (r == rows_.end()) return std::nullopt;
  auto it = r->second.find(key);
  if (it == r->second.end()) return std::nullopt;
  return it->second;
}

std::optional<SeriesStats> series_stats(const std::vector<double>& values, std::size_t window) {
  std::vector<double> v;
  for (double x : values)
    if (std::isfinite(x)) v.push_back(x);
  if (v.empty()) return std::nullopt;
  SeriesStats s;
  s.n = v.size();
  s.first = v.front();
  s.last = v.back();
  s.min = *std::min_element(v.begin(), v.end());
  s.max = *std::max_element(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  std::size_t w = std::clamp<std::size_t>(window, 1, v.size());
  double head = 0, tail = 0;
  for (std::size_t i = 0; i < w; ++i) {
    head += v[i];
    tail += v[v.size() - w + i];
  }
  s.mean_first = head / static_cast<double>(w);
  s.mean_last = tail / static_cast<double>(w);
  return s;
}

}  // namespace lorasync::report
