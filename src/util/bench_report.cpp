#include "util/bench_report.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <fmt/format.h>

namespace lorasync {

void BenchReporter::emit(BenchRecord r) {
  nlohmann::json j;
  j["bench"] = r.bench;
  j["metric"] = r.metric;
  j["value"] = r.value;
  j["unit"] = r.unit;
  if (r.baseline && *r.baseline != 0) {
    j["baseline"] = *r.baseline;
    j["ratio"] = r.value / *r.baseline;
  } else {
    j["baseline"] = nullptr;
    j["ratio"] = nullptr;
  }
  j["config"] = r.config;
  std::fputs((j.dump() + "\n").c_str(), stdout);
  std::fflush(stdout);
  records_.push_back(std::move(r));
}

void BenchReporter::print_table() const {
  std::fputs(fmt::format("{:<10} {:<34} {:>14} {:<10} {:>14} {:>8}  {}\n", "bench", "metric",
                         "value", "unit", "baseline", "ratio", "config")
                 .c_str(),
             stderr);
  for (const auto& r : records_) {
    std::string base = r.baseline ? fmt::format("{:.4g}", *r.baseline) : "-";
    std::string ratio =
        (r.baseline && *r.baseline != 0) ? fmt::format("{:.3f}", r.value / *r.baseline) : "-";
    std::fputs(fmt::format("{:<10} {:<34} {:>14.4g} {:<10} {:>14} {:>8}  {}\n", r.bench, r.metric,
                           r.value, r.unit, base, ratio, r.config.dump())
                   .c_str(),
               stderr);
  }
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double percentile(std::vector<double> s, double p) {
  if (s.empty()) return 0;
  std::sort(s.begin(), s.end());
  double pos = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(s.size() - 1);
  auto lo = static_cast<std::size_t>(pos);
  std::size_t hi = std::min(lo + 1, s.size() - 1);
  double frac = pos - static_cast<double>(lo);
  return s[lo] * (1 - frac) + s[hi] * frac;
}

std::vector<std::pair<double, double>> alternate_pairs(int n, const std::function<double(bool)>& run) {
  std::vector<std::pair<double, double>> out;
  for (int r = 0; r < n; ++r) {
    double candidate = 0, baseline = 0;
    if (r % 2 == 0) {
      candidate = run(true);
      baseline = run(false);
    } else {
      baseline = run(false);
      candidate = run(true);
    }
    out.emplace_back(candidate, baseline);
  }
  return out;
}

}  // namespace lorasync
