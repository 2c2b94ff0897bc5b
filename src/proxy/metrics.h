// proxy/metrics.h: Prometheus counters, gauges and histograms of the proxy (proxy.md §4.8).
// Labels are pre-rendered strings ('replica="0",kind="timeout"'). Histograms span 0.5 ms to 600 s
// in x2.5 steps.
// Each series is a cell that lives as long as the Metrics: the request path looks its cells up
// once (counter_cell / histogram_cell) and then updates them with a relaxed atomic add, no lock
// and no string built per request. inc/observe by name are for the rare paths.
// Thread-safety: all members are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::proxy {

const std::vector<double>& histogram_bounds();

class Metrics {
 public:
  class Counter {
   public:
    void inc(double by = 1) { v_.fetch_add(by, std::memory_order_relaxed); }
    double value() const { return v_.load(std::memory_order_relaxed); }

   private:
    std::atomic<double> v_{0};
  };
  class Histogram {
   public:
    Histogram() : buckets_(histogram_bounds().size()) {}
    void observe(double seconds);
    // Bucket counts (not cumulative), sum and count; read without a lock, so a scrape may see an
    // observation in `count` a moment before its bucket.
    std::uint64_t bucket(std::size_t i) const { return buckets_[i].load(std::memory_order_relaxed); }
    double sum() const { return sum_.load(std::memory_order_relaxed); }
    std::uint64_t count() const { return count_.load(std::memory_order_relaxed); }

   private:
    std::vector<std::atomic<std::uint64_t>> buckets_;
    std::atomic<double> sum_{0};
    std::atomic<std::uint64_t> count_{0};
  };

  // The cell of one series, created on first use; the reference stays valid.
  Counter& counter_cell(std::string_view name, std::string_view labels = {});
  Histogram& histogram_cell(std::string_view name, std::string_view labels);
  void inc(std::string_view name, std::string_view labels = {}, double by = 1) { counter_cell(name, labels).inc(by); }
  void observe(std::string_view name, std::string_view labels, double seconds) {
    histogram_cell(name, labels).observe(seconds);
  }
  double counter(std::string_view name, std::string_view labels = {}) const;
  // Appends counters and histograms in the text exposition format (names get the prefix).
  void render(std::string& out, const std::string& prefix) const;

 private:
  template <typename T>
  using Series = std::map<std::string, std::map<std::string, std::unique_ptr<T>, std::less<>>, std::less<>>;
  mutable std::mutex mu_;  // guards the maps (not the cells)
  Series<Counter> counters_;
  Series<Histogram> hists_;
};

}  // namespace lorasync::proxy
