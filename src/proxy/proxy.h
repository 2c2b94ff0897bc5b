// proxy/proxy.h: `lorasync proxy`, one HTTP endpoint in front of N inference replicas
// (proxy.md). Routed requests go through the prefix-affinity router (router.h); adapter loads are
// all-or-nothing across the fleet; health, registry re-sync and reconciliation keep every replica
// in service equal (fleet.cpp).
//
// Thread model: the http::Server's io_context threads run every client connection (one strand
// each) and the background coroutines (one health loop per replica, reconciliation, stats log).
// The router holds one mutex for O(blocks) work; fleet operations take one FIFO async lock that
// routing never waits on.
// Thread-safety: all public members are thread-safe.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "proxy/config.h"

namespace lorasync::proxy {

class Proxy {
 public:
  explicit Proxy(ProxyConfig config);  // config must be resolved (resolve_config)
  ~Proxy();
  void start();                        // listen and serve; Environment error if bind fails
  std::uint16_t port() const;
  void stop();                         // stop accepting, drain for shutdown_grace, stop
  void wait();
  nlohmann::json stats() const;        // GET /proxy/stats
  std::string metrics() const;         // GET /metrics

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorasync::proxy
