#include "rl/metrics_endpoint.h"

#include <utility>  // before Asio's coroutine headers (Boost 1.74 + g++ 12)

#include <cmath>
#include <mutex>

#include <fmt/format.h>

#include "http/server.h"

namespace lorasync::rl {

struct MetricsEndpoint::Impl {
  std::mutex mu;
  std::string text;
  std::unique_ptr<http::Server> server;
};

MetricsEndpoint::MetricsEndpoint(const std::string& host, std::uint16_t port) : impl_(std::make_unique<Impl>()) {
  http::ServerOptions o;
  o.host = host;
  o.port = port;
  Impl* I = impl_.get();
  impl_->server = std::make_unique<http::Server>(o, [I](http::Request& req, http::ResponseWriter& w) -> http::Task<void> {
    http::Response r;
    const std::string path = req.target.substr(0, req.target.find('?'));
    if (path == "/metrics") {
      r.status = 200;
      r.headers.add("Content-Type", "text/plain; version=0.0.4");
      std::lock_guard lk(I->mu);
      r.body = I->text;
    } else if (path == "/health") {
      r = http::json_response(200, "{\"status\":\"ok\"}");
    } else {
      r = http::json_response(404, "{\"error\":{\"message\":\"not found: " + path + "\"}}");
    }
    co_await w.send(std::move(r));
  });
  impl_->server->start();
}

MetricsEndpoint::~MetricsEndpoint() { impl_->server->stop(1.0); }

std::uint16_t MetricsEndpoint::port() const { return impl_->server->port(); }

void MetricsEndpoint::publish(std::string text) {
  std::lock_guard lk(impl_->mu);
  impl_->text = std::move(text);
}

std::string prometheus_text(const std::map<std::string, double>& values) {
  std::string out;
  for (const auto& [k, v] : values) {
    if (!std::isfinite(v)) continue;
    std::string name = "lorasync_trainer_";
    for (char c : k) name += (std::isalnum(static_cast<unsigned char>(c)) || c == '_') ? c : '_';
    const bool counter = k.size() > 6 && k.compare(k.size() - 6, 6, "_total") == 0;
    out += fmt::format("# TYPE {} {}\n{} {}\n", name, counter ? "counter" : "gauge", name, v);
  }
  return out;
}

}  // namespace lorasync::rl
