#include "proxy/config.h"

#include <cstdlib>
#include <thread>

#include "util/error.h"
#include "util/strings.h"

namespace lorasync::proxy {

namespace {
std::string env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  return v ? std::string(v) : std::string();
}
void need(bool ok, const char* setting, const std::string& what) {
  if (!ok) throw Error(ErrorKind::kInvalidInput, std::string(setting) + ": " + what, setting);
}
}  // namespace

void resolve_config(ProxyConfig& c) {
  if (c.upstreams.empty()) {
    for (auto& u : split(env("UPSTREAM_URLS"), ','))
      if (!trim(u).empty()) c.upstreams.emplace_back(trim(u));
  }
  need(!c.upstreams.empty(), "--upstream", "at least one upstream URL is required (or UPSTREAM_URLS)");
  need(c.upstreams.size() <= 64, "--upstream", "at most 64 upstreams, got " + std::to_string(c.upstreams.size()));
  c.urls.clear();
  for (const auto& u : c.upstreams) {
    std::string err;
    auto url = http::Url::parse(trim(u), err);
    need(url.has_value(), "--upstream", "bad URL '" + u + "': " + err);
    for (const auto& prev : c.urls) need(prev.str() != url->str(), "--upstream", "duplicate upstream " + url->str());
    c.urls.push_back(*url);
  }
  // Listen address.
  {
    auto colon = c.listen.rfind(':');
    need(colon != std::string::npos, "--listen", "expected HOST:PORT, got '" + c.listen + "'");
    c.host = c.listen.substr(0, colon);
    if (c.host.size() >= 2 && c.host.front() == '[' && c.host.back() == ']') c.host = c.host.substr(1, c.host.size() - 2);
    std::string port = c.listen.substr(colon + 1);
    std::string penv = env("PROXY_PORT");
    if (!penv.empty() && env("PROXY_LISTEN").empty()) port = penv;
    char* end = nullptr;
    long p = std::strtol(port.c_str(), &end, 10);
    need(!port.empty() && *end == 0 && p >= 0 && p <= 65535, "--listen", "bad port '" + port + "'");
    need(!c.host.empty(), "--listen", "missing host in '" + c.listen + "'");
    c.port = static_cast<std::uint16_t>(p);
  }
  need(c.block_size >= 1 && c.block_size <= 65536, "--block-size", "must be in [1, 65536], got " + std::to_string(c.block_size));
  need(c.imbalance >= 0, "--imbalance", "must be >= 0");
  need(c.max_tracked_blocks >= 1 && c.max_tracked_blocks <= 100000000, "--max-tracked-blocks", "must be in [1, 1e8]");
  auto pos = [&](double v, const char* name) { need(v > 0, name, "must be > 0, got " + std::to_string(v)); };
  auto nonneg = [&](double v, const char* name) { need(v >= 0, name, "must be >= 0 (0 = off), got " + std::to_string(v)); };
  pos(c.adapter_retry_interval, "--adapter-retry-interval");
  pos(c.adapter_load_deadline, "--adapter-load-deadline");
  pos(c.adapter_attempt_timeout, "--adapter-attempt-timeout");
  pos(c.connect_timeout, "--connect-timeout");
  pos(c.first_byte_timeout, "--first-byte-timeout");
  pos(c.idle_timeout, "--idle-timeout");
  nonneg(c.total_timeout, "--total-timeout");
  pos(c.control_timeout, "--control-timeout");
  pos(c.client_timeout, "--client-timeout");
  need(c.eject_after >= 1, "--eject-after", "must be >= 1");
  need(c.recover_after >= 1, "--recover-after", "must be >= 1");
  pos(c.eject_cooldown, "--eject-cooldown");
  pos(c.probe_interval, "--probe-interval");
  pos(c.probe_timeout, "--probe-timeout");
  nonneg(c.reconcile_interval, "--reconcile-interval");
  need(c.conn_limit >= static_cast<std::int64_t>(c.urls.size()), "--conn-limit", "must be >= the number of upstreams");
  pos(c.upstream_keepalive, "--upstream-keepalive");
  need(c.threads >= 0 && c.threads <= 256, "--threads", "must be in [0, 256]");
  if (c.threads == 0) c.threads = std::min<std::int64_t>(4, std::max(1u, std::thread::hardware_concurrency()));
  nonneg(c.unload_drain_timeout, "--unload-drain-timeout");
  need(c.spill_wait >= 0 && c.spill_wait <= 10, "--spill-wait", "must be in [0, 10] seconds (0 = spill at once)");
  need(c.max_retries >= 0 && c.max_retries <= 63, "--max-retries", "must be in [0, 63]");
  need(c.health_quorum >= 0 && c.health_quorum <= static_cast<std::int64_t>(c.urls.size()), "--health-quorum",
       "must be in [0, number of upstreams]");
  need(c.max_body_bytes >= 1, "--max-body-bytes", "must be >= 1");
  need(c.max_push_bytes >= 1, "--max-push-bytes", "must be >= 1");
  need(c.max_connections >= 0, "--max-connections", "must be >= 0 (0 = from the open-file limit)");
  nonneg(c.stats_log_interval, "--stats-log-interval");
  nonneg(c.shutdown_grace, "--shutdown-grace");
  if (!c.api_key_env.empty()) {
    c.api_key = env(c.api_key_env);
    need(!c.api_key.empty(), "--api-key-env", "variable " + c.api_key_env + " is unset or empty");
  }
  c.upstream_token = c.upstream_token_env.empty() ? std::string() : env(c.upstream_token_env);
  if (!c.upstream_token.empty() && !c.allow_insecure_upstream_token) {
    for (const auto& u : c.urls)
      need(u.tls() || u.is_loopback(), "--upstream-token-env",
           "refusing to send the token in " + c.upstream_token_env + " over plain http to " + u.str() +
               " (use https or --allow-insecure-upstream-token)");
  }
}

}  // namespace lorasync::proxy
