// rl/metrics_endpoint.h: the trainer's Prometheus endpoint (trainer.md §6): GET /metrics on
// logging.metrics_bind:metrics_port serves the latest text set by publish(); GET /health answers
// 200. Port 0 = any free port (see port()).
// Thread-safety: publish() may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace lorasync::rl {

class MetricsEndpoint {
 public:
  MetricsEndpoint(const std::string& host, std::uint16_t port);
  ~MetricsEndpoint();
  std::uint16_t port() const;
  void publish(std::string text);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Prometheus text of numeric metrics: lorasync_trainer_<key> with [^A-Za-z0-9_] -> '_';
// *_total as counters, the rest as gauges.
std::string prometheus_text(const std::map<std::string, double>& values);

}  // namespace lorasync::rl
