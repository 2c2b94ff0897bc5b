// proxy/metrics.h: Prometheus counters, gauges and histograms of the proxy (proxy.md §4.8).
// Labels are pre-rendered strings ('replica="0",kind="timeout"'). Histograms span 0.5 ms to 600 s
// in x2.5 steps.
// Thread-safety: all members are thread-safe (one mutex; a handful of updates per request).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace lorasync::proxy {

class Metrics {
 public:
  void inc(const std::string& name, const std::string& labels = {}, double by = 1);
  void observe(const std::string& name, const std::string& labels, double seconds);
  double counter(const std::string& name, const std::string& labels = {}) const;
  // Appends counters and histograms in the text exposition format (names get the prefix).
  void render(std::string& out, const std::string& prefix) const;

 private:
  struct Hist {
    std::vector<std::uint64_t> buckets;
    double sum = 0;
    std::uint64_t count = 0;
  };
  mutable std::mutex mu_;
  std::map<std::string, std::map<std::string, double>> counters_;
  std::map<std::string, std::map<std::string, Hist>> hists_;
};

const std::vector<double>& histogram_bounds();

}  // namespace lorasync::proxy
