// The proxy integration tests' fixture: an in-process Proxy in front of in-process stub replicas,
// all on loopback port 0, and a blocking client call. Shared by conformance_test.cpp and
// fleet_waits_test.cpp.
#pragma once

#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/proxy/stub_replica.h"
#include "http/client.h"
#include "proxy/proxy.h"

namespace lorasync::proxy::fixture {

using nlohmann::json;

struct Reply {
  int status = 0;
  http::Headers headers;
  std::string body;
  http::CallError error = http::CallError::kNone;
  json j() const { return json::parse(body, nullptr, false); }
};

inline Reply call(std::uint16_t port, const std::string& method, const std::string& target, const std::string& body = "",
           http::Headers h = {}, double timeout = 10) {
  std::string err;
  boost::asio::io_context ioc;  // outlives the pool (its sockets belong to it)
  http::Pool pool(*http::Url::parse("http://127.0.0.1:" + std::to_string(port), err), http::ClientOptions{});
  Reply r;
  if (!h.has("content-type") && !body.empty()) h.add("Content-Type", "application/json");
  boost::asio::co_spawn(ioc, [&]() -> http::Task<void> {
    http::CallOptions o;
    o.total_timeout_s = timeout;
    auto f = co_await pool.fetch({method, target, &h, body}, o);
    r.status = f.status;
    r.headers = f.headers;
    r.body = f.body;
    r.error = f.error;
  }, boost::asio::detached);
  ioc.run();
  return r;
}

inline std::string ids_prompt(const std::vector<int>& syms, const std::string& model = "m") {
  std::string s = "{\"model\":\"" + model + "\",\"prompt\":[";
  bool first = true;
  for (int sym : syms)
    for (int i = 0; i < 16; ++i) {
      s += first ? "" : ",";
      first = false;
      s += std::to_string(sym);
    }
  return s + "],\"max_tokens\":4}";
}

struct Fleet {
  std::vector<std::unique_ptr<bench::StubReplica>> stubs;
  std::unique_ptr<Proxy> proxy;
  explicit Fleet(int n, std::function<void(ProxyConfig&)> tweak = {}, std::function<void(bench::StubOptions&, int)> stub_tweak = {}) {
    ProxyConfig c;
    for (int i = 0; i < n; ++i) {
      bench::StubOptions so;
      so.index = i;
      if (stub_tweak) stub_tweak(so, i);
      stubs.push_back(std::make_unique<bench::StubReplica>(so));
      stubs.back()->start();
      c.upstreams.push_back(stubs.back()->url());
    }
    c.listen = "127.0.0.1:0";
    c.upstream_token_env = "LORASYNC_TEST_TOKEN_UNSET";
    c.stats_log_interval = 0;
    c.probe_interval = 0.2;
    c.probe_timeout = 1;
    c.eject_cooldown = 0.2;
    c.adapter_retry_interval = 0.05;
    c.adapter_load_deadline = 5;
    c.shutdown_grace = 1;
    c.threads = 2;
    if (tweak) tweak(c);
    resolve_config(c);
    cfg = c;
    proxy = std::make_unique<Proxy>(c);
    proxy->start();
  }
  ProxyConfig cfg;
  // A proxy restart: the same replicas, a new proxy process (its registry starts empty).
  void restart_proxy() {
    proxy->stop();
    proxy = std::make_unique<Proxy>(cfg);
    proxy->start();
  }
  ~Fleet() {
    proxy->stop();
    for (auto& s : stubs) s->stop();
  }
  std::uint16_t port() const { return proxy->port(); }
  int count(int stub, const std::string& path) const {
    int n = 0;
    for (const auto& c : stubs[static_cast<std::size_t>(stub)]->calls())
      if (c.target == path) ++n;
    return n;
  }
};

// Waits (bounded) until `done` holds; returns whether it did.
inline bool eventually(const std::function<bool()>& done, double seconds = 10) {
  for (int i = 0; i < static_cast<int>(seconds * 100); ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

}  // namespace lorasync::proxy::fixture
