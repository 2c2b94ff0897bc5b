// Request handling of the proxy: dispatch by exact path (proxy.md §2), inbound auth, request
// ids, and the relay of routed and forwarded requests with retries before the first byte,
// streaming pass-through and client-disconnect cancellation (§4.1, §4.5).
#include <utility>

#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/redirect_error.hpp>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <random>
#include <thread>

#include "core/io/adapter_manifest.h"
#include "proxy/prompt_scan.h"
#include "proxy/proxy_impl.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/process.h"
#include "util/sha256.h"

namespace lorasync::proxy {

namespace net = boost::asio;

http::Task<void> sleep_for(double seconds) {
  net::steady_timer t(co_await net::this_coro::executor);
  t.expires_after(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::max(0.0, seconds))));
  boost::system::error_code ec;
  co_await t.async_wait(net::redirect_error(net::use_awaitable, ec));
}

const char* state_name(ReplicaState s) {
  switch (s) {
    case ReplicaState::kInService: return "in_service";
    case ReplicaState::kEjected: return "ejected";
    case ReplicaState::kProbing: return "probing";
    case ReplicaState::kSyncing: return "syncing";
  }
  return "?";
}

namespace {

RouterOptions router_options(const ProxyConfig& c) {
  RouterOptions o;
  o.n_replicas = static_cast<int>(c.urls.size());
  o.max_tracked_blocks = static_cast<std::size_t>(c.max_tracked_blocks);
  o.imbalance = c.imbalance;
  o.block_size = static_cast<std::size_t>(c.block_size);
  return o;
}

bool is_visible_ascii(std::string_view s) {
  for (char c : s)
    if (c < 0x21 || c > 0x7e) return false;
  return true;
}

}  // namespace

Proxy::Impl::Impl(ProxyConfig c) : cfg(std::move(c)), router(router_options(cfg)) {
  if (!cfg.api_key.empty()) api_key_digest = sha256_hex(cfg.api_key);
  if (!cfg.upstream_token.empty()) upstream_authorization = "Bearer " + cfg.upstream_token;
  http::ClientOptions co;
  co.connect_timeout_s = cfg.connect_timeout;
  co.keepalive_s = cfg.upstream_keepalive;
  co.max_connections = static_cast<std::size_t>(std::max<std::int64_t>(1, cfg.conn_limit / static_cast<std::int64_t>(cfg.urls.size())));
  co.ca_file = cfg.upstream_ca_file;
  for (std::size_t i = 0; i < cfg.urls.size(); ++i) {
    auto r = std::make_unique<Replica>();
    r->index = static_cast<int>(i);
    r->url = cfg.urls[i];
    r->url_str = cfg.urls[i].str();
    r->pool = std::make_unique<http::Pool>(cfg.urls[i], co);
    replicas.push_back(std::move(r));
  }
  http::ServerOptions so;
  so.host = cfg.host;
  so.port = cfg.port;
  so.threads = static_cast<int>(cfg.threads);
  so.max_body_bytes = static_cast<std::uint64_t>(cfg.max_body_bytes);
  so.route_body_limits = {{std::string(io::kPushPath), static_cast<std::uint64_t>(cfg.max_push_bytes)}};
  so.client_timeout_s = cfg.client_timeout;
  // Each client connection may hold an upstream one too (at most conn_limit in all): the
  // upstreams get up to half of the descriptor budget, the clients the rest.
  const std::size_t budget = connection_budget();
  const std::size_t upstream = std::min(static_cast<std::size_t>(cfg.conn_limit), budget / 2);
  so.max_connections = cfg.max_connections > 0 ? static_cast<std::size_t>(cfg.max_connections)
                                               : std::max<std::size_t>(64, budget - upstream);
  so.idle_timeout_s = 75;
  server = std::make_unique<http::Server>(so, [this](http::Request& rq, http::ResponseWriter& w) { return handle(rq, w); });
  init_metric_cells();
}

void Proxy::Impl::init_metric_cells() {
  for (int i = 0; i < 3; ++i) {
    const std::string route = std::string("route=\"") + kRelayRoutes[i] + "\"";
    route_cells[i].ok = &metrics.counter_cell("requests_total", route + ",code=\"200\"");
    route_cells[i].duration = &metrics.histogram_cell("request_duration_seconds", route);
    route_cells[i].ttfb[0] = &metrics.histogram_cell("time_to_first_byte_seconds", route + ",stream=\"false\"");
    route_cells[i].ttfb[1] = &metrics.histogram_cell("time_to_first_byte_seconds", route + ",stream=\"true\"");
  }
  for (std::size_t r = 0; r < replicas.size(); ++r)
    routed_cells.push_back(&metrics.counter_cell("routed_total", "replica=\"" + std::to_string(r) + "\""));
  decision_seconds = &metrics.histogram_cell("route_decision_seconds", "");
  spill_wait_cells[0] = &metrics.counter_cell("spill_waits_total", "result=\"kept\"");
  spill_wait_cells[1] = &metrics.counter_cell("spill_waits_total", "result=\"spilled\"");
  for (int o = 0; o < kOutcomeCount; ++o)
    for (int r = 0; r < kReasonCount; ++r)
      decision_cells[o][r] = &metrics.counter_cell(
          "route_decisions_total", std::string("outcome=\"") + outcome_name(static_cast<Outcome>(o)) +
                                       "\",reason=\"" + reason_name(static_cast<Reason>(r)) + "\"");
}

std::uint64_t Proxy::Impl::in_service_mask() const {
  std::uint64_t m = 0;
  for (const auto& r : replicas)
    if (r->get() == ReplicaState::kInService) m |= std::uint64_t{1} << r->index;
  return m;
}

std::string Proxy::Impl::redact(std::string s) const {
  const std::string& t = cfg.upstream_token;
  if (t.empty()) return s;
  for (std::size_t p; (p = s.find(t)) != std::string::npos;) s.replace(p, t.size(), "***");
  return s;
}

http::CallOptions Proxy::Impl::call_options(double total, http::CancelSignal* cancel, bool fresh) const {
  http::CallOptions o;
  o.first_byte_timeout_s = cfg.first_byte_timeout;
  o.idle_timeout_s = cfg.idle_timeout;
  o.total_timeout_s = total;
  o.cancel = cancel;
  o.fresh_connection = fresh;
  if (total > 0) {
    o.first_byte_timeout_s = std::min(o.first_byte_timeout_s, total);
    o.idle_timeout_s = std::min(o.idle_timeout_s, total);
  }
  return o;
}

http::Headers Proxy::Impl::upstream_headers(const http::Request& req, const std::string& rid) const {
  http::Headers h = http::strip_hop_by_hop(req.headers);
  h.remove("host");
  h.remove("content-length");
  h.remove("authorization");
  h.remove("x-request-id");
  h.remove("expect");  // the proxy already holds the whole body: no 100-continue upstream
  h.add("X-Request-Id", rid);
  if (!upstream_authorization.empty()) h.add("Authorization", upstream_authorization);
  return h;
}

Proxy::Impl::RequestId Proxy::Impl::request_id(const http::Request& req) {
  RequestId id;
  if (const auto* x = req.headers.find("x-request-id"); x && !x->empty() && x->size() <= sizeof id.buf && is_visible_ascii(*x)) {
    std::memcpy(id.buf, x->data(), x->size());
    id.n = static_cast<std::uint8_t>(x->size());
    return id;
  }
  random_hex(16, id.buf);  // 128 random bits, as http::random_request_id(), without its string
  id.n = 32;
  return id;
}

bool Proxy::Impl::authorized(const http::Request& req) const {
  if (cfg.api_key.empty()) return true;
  const std::string* a = req.headers.find("authorization");
  if (a == nullptr) return false;
  std::string given = (a->size() > 7 && http::iequals(a->substr(0, 7), "Bearer ")) ? a->substr(7) : std::string();
  // Compared as digests, every byte: no timing signal about how much of the key matched.
  const std::string d1 = sha256_hex(given);
  unsigned char diff = 0;
  for (std::size_t i = 0; i < d1.size(); ++i) diff |= static_cast<unsigned char>(d1[i] ^ api_key_digest[i]);
  return diff == 0;
}

// Not a coroutine: a routed generation request goes straight to handle_relay, without a frame of
// its own (this one was 2 KB, in glibc's slowest size classes, allocated and freed per request).
// Everything else, and a routed request refused (authentication, a compressed body), goes
// through handle_other.
http::Task<void> Proxy::Impl::handle(http::Request& req, http::ResponseWriter& w) {
  const std::string_view path = req.path();
  if (req.method == "POST" && (path == "/v1/completions" || path == "/v1/chat/completions") && authorized(req)) {
    const auto* ce = req.headers.find("content-encoding");
    if (ce == nullptr || http::iequals(*ce, "identity")) return handle_relay(req, w, true, request_id(req));
  }
  return handle_other(req, w);
}

http::Task<void> Proxy::Impl::handle_other(http::Request& req, http::ResponseWriter& w) {
  const auto t0 = Clock::now();
  const RequestId rid_id = request_id(req);
  const std::string rid(rid_id.view());
  const std::string path(req.path());
  std::string route = "other";
  int code = 0;
  auto reply = [&](http::Response r) -> http::Task<void> {
    r.headers.add("X-Request-Id", rid);
    code = r.status;
    co_await w.send(std::move(r));
  };
  auto err = [&](int status, const std::string& msg, const std::string& param = {}) {
    return http::error_response(status, "proxy: " + msg, param, status >= 500 ? "proxy_error" : "");
  };

  if (!authorized(req)) {
    auto r = err(401, "missing or invalid API key");
    r.headers.add("WWW-Authenticate", "Bearer");
    rejected.fetch_add(1);
    metrics.inc("rejected_requests_total", "reason=\"auth\"");
    co_await reply(std::move(r));
    metrics.inc("requests_total", "route=\"auth\",code=\"401\"");
    co_return;
  }

  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (req.method == "POST") {
      route = path == "/v1/completions" ? "completions" : "chat_completions";
      if (const auto* ce = req.headers.find("content-encoding"); ce && !http::iequals(*ce, "identity")) {
        rejected.fetch_add(1);
        metrics.inc("rejected_requests_total", "reason=\"content_encoding\"");
        http::Response r = err(415, "compressed request bodies are not accepted on routed paths (Content-Encoding: " + *ce + ")");
        co_await reply(std::move(r));
      } else {
        co_await handle_relay(req, w, true, rid_id);
        code = -1;
      }
    } else {
      co_await handle_relay(req, w, false, rid_id);
      code = -1;
    }
  } else if (path == "/v1/load_lora_adapter") {
    route = "load";
    http::Response r;
    if (req.method == "POST") r = co_await handle_load(req, rid);
    else r = co_await handle_broadcast(req, rid);
    co_await reply(std::move(r));
  } else if (path == io::kPushPath) {
    route = "push";
    http::Response r;
    if (req.method == "POST") r = co_await handle_push(req, rid);
    else {
      r = err(405, "method " + req.method + " not allowed on " + path);
      r.headers.add("Allow", "POST");
    }
    co_await reply(std::move(r));
  } else if (path == io::kPreparePath || path == io::kCommitPath || path == io::kAbortPath) {
    // The proxy runs both phases itself: a client preparing replicas one by one would bypass the
    // all-or-nothing commit.
    route = "push";
    http::Response r = err(404, "the proxy runs the prepare and commit phases itself: POST the adapter to " + std::string(io::kPushPath));
    co_await reply(std::move(r));
  } else if (path == "/v1/unload_lora_adapter" || path == "/pause" || path == "/resume" || path == "/reset_prefix_cache") {
    route = path.substr(1);
    if (route.starts_with("v1/")) route = route.substr(3);
    http::Response r = co_await handle_broadcast(req, rid);
    co_await reply(std::move(r));
  } else if (path == "/health" || path == "/ping") {
    route = path.substr(1);
    http::Response r = co_await handle_fan_in(req, rid);
    co_await reply(std::move(r));
  } else if (path == "/proxy/stats" || path == "/metrics") {
    route = path == "/metrics" ? "metrics" : "stats";
    if (req.method != "GET") {
      auto r = err(405, "method " + req.method + " not allowed on " + path);
      r.headers.add("Allow", "GET");
      co_await reply(std::move(r));
    } else if (path == "/metrics") {
      http::Response r;
      r.headers.add("Content-Type", "text/plain; version=0.0.4");
      r.body = metrics_text();
      co_await reply(std::move(r));
    } else {
      http::Response r = http::json_response(200, stats_json().dump());
      co_await reply(std::move(r));
    }
  } else {
    co_await handle_relay(req, w, false, rid_id);
    code = -1;
  }
  // (A relayed request, code -1, counted itself in handle_relay.)
  if (code > 0) {
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    metrics.observe("request_duration_seconds", "route=\"" + route + "\"", dt);
    metrics.inc("requests_total", "route=\"" + route + "\",code=\"" + std::to_string(code) + "\"");
  }
}

// Routed (routed = true) or forwarded request: pick, call, retry before the first byte, relay.
http::Task<void> Proxy::Impl::handle_relay(http::Request& req, http::ResponseWriter& w, bool routed,
                                           RequestId rid_id) {
  const auto t0 = Clock::now();
  const std::string_view rid = rid_id.view();
  const int route_index = routed ? (req.path() == "/v1/completions" ? 0 : 1) : 2;
  const char* const route = kRelayRoutes[route_index];
  RouteCells& cells = route_cells[route_index];
  auto finish_code = [&](int code) {
    if (code == 200) cells.ok->inc();
    else metrics.inc("requests_total", std::string("route=\"") + route + "\",code=\"" + std::to_string(code) + "\"");
  };
  auto count_client_abort = [this] {
    client_aborts.fetch_add(1);
    metrics.inc("client_aborts_total");
  };
  auto send_error = [&](int status, const std::string& msg, const std::string& param = {}) -> http::Task<void> {
    auto r = http::error_response(status, "proxy: " + redact(msg), param, status >= 500 ? "proxy_error" : "");
    r.headers.add("X-Request-Id", std::string(rid));
    finish_code(status);
    co_await w.send(std::move(r));
  };

  PromptScan scan;
  if (routed) {
    if (auto e = scan_routed_request(req.body, static_cast<std::size_t>(cfg.block_size), scan)) {
      rejected.fetch_add(1);
      metrics.inc("rejected_requests_total", "reason=\"bad_request\"");
      co_await send_error(400, e->message, e->param);
      co_return;
    }
  }
  // Labels the first-byte histogram (TTFT for SSE): the scanner's top-level `stream`, not a search
  // of the body (which took `"stream": false, "echo": true` for a stream).
  const bool stream = routed && scan.stream;
  // The client's headers go upstream as received (the pool leaves out hop-by-hop fields, Host and
  // Content-Length), less the ones the proxy sets or answers itself: no copy of them per request
  // (a copy was five allocations). Control routes build theirs with upstream_headers(), which
  // leaves out the same.
  static constexpr std::string_view kNotForwarded[] = {"authorization", "x-request-id", "expect"};
  const std::pair<std::string_view, std::string_view> added[] = {{"X-Request-Id", rid},
                                                                 {"Authorization", upstream_authorization}};
  const http::OutRequest out{req.method, req.target, &req.headers, req.body, kNotForwarded,
                             std::span(added, upstream_authorization.empty() ? 1 : 2)};
  http::CancelSignal& gone = w.client_gone();

  std::uint64_t tried = 0;
  int attempts = 0;
  bool first = true;
  std::optional<http::Pool::Full> last_5xx;  // an upstream answer we retried (5xx, 429) kept for the final reply
  std::string last_error;  // set by each failed attempt (with none, the answer says no replica is in service)
  int last_status = 503;
  thread_local std::mt19937_64 jitter_rng{std::hash<std::thread::id>{}(std::this_thread::get_id())};

  // Delay scheduling for locality: a first decision that would spill for imbalance waits up to
  // --spill-wait for its replica's load to come back within the bound (each release on that
  // replica wakes it; one elsewhere cannot help), then is taken again, the last time spilling if
  // it must. A spill costs more than the wait: the prompt is prefilled again elsewhere, and its
  // blocks, now owned by every replica, count as common for the rest of its group.
  std::optional<Clock::time_point> spill_deadline;
  for (;;) {
    std::uint64_t eligible = in_service_mask() & ~tried;
    int pick = -1;
    Decision d;
    if (eligible != 0) {
      if (routed) {
        const auto td = Clock::now();
        const bool may_defer = first && cfg.spill_wait > 0 && (!spill_deadline || td < *spill_deadline);
        d = router.route(scan.blocks, eligible, first, scan.model, may_defer);
        decision_seconds->observe(std::chrono::duration<double>(Clock::now() - td).count());
        if (d.deferred) {
          if (!spill_deadline)
            spill_deadline = td + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.spill_wait));
          const int owner = d.pick;
          Notifier& released = replicas[static_cast<std::size_t>(owner)]->load_released;
          // A client that leaves ends its wait at once (its departure is announced like a release;
          // nothing was recorded for a deferred decision, so nothing is undone).
          const http::CancelSignal::Id left = gone.subscribe([&released] { released.notify_all(); });
          co_await released.wait_until(
              [this, owner, eligible, &gone] { return gone.fired() || router.within_imbalance(owner, eligible); },
              *spill_deadline);
          gone.unsubscribe(left);
          if (gone.fired()) {
            count_client_abort();
            w.abort();
            co_return;
          }
          continue;
        }
        pick = d.pick;
        if (first && spill_deadline) spill_wait_cells[d.outcome == Outcome::kSpilled ? 1 : 0]->inc();
        if (first) decision_cells[static_cast<int>(d.outcome)][static_cast<int>(d.reason)]->inc();
      } else {
        pick = __builtin_ctzll(eligible);  // the primary: lowest index in service, untried
      }
    }
    if (pick < 0) {
      if (routed && !first) finish_routed(scan.model, std::nullopt);
      if (last_5xx) {
        http::Response r;
        r.status = last_5xx->status;
        r.headers = http::strip_hop_by_hop(last_5xx->headers);
        r.headers.set("X-Request-Id", std::string(rid));
        r.headers.set("X-Proxy-Attempts", std::to_string(attempts));
        r.body = std::move(last_5xx->body);
        finish_code(r.status);
        co_await w.send(std::move(r));
      } else {
        // (No conditional expressions inside co_await arguments: g++ 12 double-destroys their temporaries.)
        int st = last_status;
        std::string msg = last_error;
        if (attempts == 0) {
          st = 503;
          msg = "no replica in service";
        }
        co_await send_error(st, msg);
      }
      co_return;
    }
    first = false;
    ++attempts;
    tried |= std::uint64_t{1} << pick;
    Replica& rep = *replicas[static_cast<std::size_t>(pick)];
    rep.inflight_all.fetch_add(1);
    routed_cells[static_cast<std::size_t>(pick)]->inc();
    // The replica's in-flight count (the router's load signal) drops when the upstream has
    // answered in full, not after the relay to the client: a slow client, or the proxy's own
    // writing, is no load on the replica (and counting it made spills, hence unmatched routing,
    // more frequent the faster the answers came).
    struct Release {
      Proxy::Impl* self;
      Replica* rep;
      bool routed;
      int pick;
      bool released = false;
      void now() {
        if (released) return;
        released = true;
        rep->inflight_all.fetch_sub(1);
        if (routed) {
          self->router.release(pick);
          rep->load_released.notify_all();
        }
      }
      ~Release() { now(); }
    } release{this, &rep, routed, pick};

    const auto tcall = Clock::now();
    http::CallResult res = co_await rep.pool->call(out, call_options(cfg.total_timeout, &gone));
    if (!res.ok()) {
      if (res.error == http::CallError::kCancelled || gone.fired()) {
        count_client_abort();
        if (routed) finish_routed(scan.model, std::nullopt);
        w.abort();
        co_return;
      }
      if (res.error == http::CallError::kLocal) {
        // The proxy itself is out of descriptors or memory: not the replica's fault (no failure
        // counted, no ejection), and no retry that would need the same resources.
        metrics.inc("local_resource_errors_total");
        if (routed) finish_routed(scan.model, std::nullopt);
        LS_LOG_ERROR("proxy", "[{}] {}", rid, res.message);
        co_await send_error(503, "the proxy is out of local resources (file descriptors or memory); retry later");
        co_return;
      }
      const bool timeout = http::is_timeout(res.error);
      note_failure(pick, http::call_error_name(res.error), true);
      last_error = "upstream " + rep.url_str + " failed: " + res.message;
      last_status = timeout ? 504 : 502;
      // A connect that timed out sent nothing (a dropped SYN on a lossy link): as safe to retry
      // elsewhere as a refused one. Other timeouts may leave a generation running: never retried.
      const bool resend_safe = !timeout || res.error == http::CallError::kConnectTimeout;
      if (!resend_safe || attempts > cfg.max_retries) {
        if (routed) finish_routed(scan.model, std::nullopt);
        co_await send_error(last_status, last_error);
        co_return;
      }
      retries.fetch_add(1);
      metrics.inc("retries_total", std::string("reason=\"") + http::call_error_name(res.error) + "\"");
      double backoff = 0.025 * static_cast<double>(1u << (attempts - 1)) *
                       (0.8 + 0.4 * static_cast<double>(jitter_rng() % 1000) / 1000.0);
      co_await sleep_for(backoff);
      continue;
    }
    auto& up = *res.response;
    const int status = up.status();
    if (status >= 500) note_failure(pick, "status_" + std::to_string(status), true);
    else note_success(pick);
    // Retried before the first byte on another replica: a replica that is down or draining
    // (502/503); for generation also a failed engine step (500) and a full queue (429, not a fault).
    // A 404 for an adapter the fleet has registered: that replica lost it (a restart); reconciliation
    // re-syncs it and the request goes to another replica.
    bool lost_adapter = false;
    if (routed && status == 404 && !scan.model.empty()) {
      const auto names = registry_names();
      lost_adapter = std::find(names.begin(), names.end(), scan.model) != names.end();
      if (lost_adapter) {
        rep.needs_resync.store(true);
        metrics.inc("lost_adapter_404_total", "replica=\"" + std::to_string(pick) + "\"");
      }
    }
    const bool retryable =
        status == 502 || status == 503 || lost_adapter || (routed && (status == 500 || status == 429));
    if (retryable && attempts <= cfg.max_retries) {
      http::Pool::Full f;
      f.status = status;
      f.headers = up.headers();
      co_await up.read_all(f.body, 1 << 20);
      last_5xx = std::move(f);
      retries.fetch_add(1);
      metrics.inc("retries_total", "reason=\"status_" + std::to_string(status) + "\"");
      double backoff = 0.025 * static_cast<double>(1u << (attempts - 1)) *
                       (0.8 + 0.4 * static_cast<double>(jitter_rng() % 1000) / 1000.0);
      co_await sleep_for(backoff);
      continue;
    }
    // Relay. The head is built from thread-local scratch headers (their strings keep their
    // capacity from request to request): start() copies them before it first suspends.
    // The proxy's own fields go into the same recycled strings (added with add(), their names of
    // 16 bytes were an allocation each per request).
    thread_local http::Headers h;
    static constexpr std::string_view kDropped[] = {"content-length", "x-request-id"};
    char upstream_digits[4], attempts_digits[12];
    const auto up_end = std::to_chars(upstream_digits, upstream_digits + sizeof upstream_digits, pick).ptr;
    const auto at_end = std::to_chars(attempts_digits, attempts_digits + sizeof attempts_digits, attempts).ptr;
    const std::pair<std::string_view, std::string_view> mine[] = {
        {"X-Request-Id", rid},
        {"X-Proxy-Upstream", std::string_view(upstream_digits, static_cast<std::size_t>(up_end - upstream_digits))},
        {"X-Proxy-Attempts", std::string_view(attempts_digits, static_cast<std::size_t>(at_end - attempts_digits))}};
    http::strip_hop_by_hop(up.headers(), h, kDropped, mine);
    CachedTokensScanner cached;
    std::optional<std::uint64_t> cached_hdr;
    if (!cfg.cached_tokens_header.empty())
      if (const auto* v = up.headers().find(cfg.cached_tokens_header)) cached_hdr = std::strtoull(v->c_str(), nullptr, 10);
    bool ok = co_await w.start(status, h, up.content_length());
    bool first_piece = true;
    while (ok) {
      std::string_view piece;
      http::CallError e = co_await up.read(piece);
      if (e != http::CallError::kNone) {
        if (e == http::CallError::kCancelled || gone.fired()) {
          count_client_abort();
        } else {
          note_failure(pick, http::call_error_name(e), true);
          LS_LOG_WARN("proxy", "[{}] upstream {} failed mid-response: {}", rid, rep.url_str, http::call_error_name(e));
        }
        w.abort();
        ok = false;
        break;
      }
      if (first_piece) {
        first_piece = false;
        cells.ttfb[stream ? 1 : 0]->observe(std::chrono::duration<double>(Clock::now() - tcall).count());
      }
      if (up.body_complete()) release.now();
      if (piece.empty() && up.done()) break;
      if (routed) cached.feed(piece);
      if (!co_await w.write(piece)) {
        count_client_abort();
        ok = false;
        break;
      }
    }
    if (ok) ok = co_await w.finish();
    if (routed) finish_routed(scan.model, cached_hdr ? cached_hdr : cached.value());
    finish_code(ok ? status : 499);
    cells.duration->observe(std::chrono::duration<double>(Clock::now() - t0).count());
    co_return;
  }
}

// ---- Proxy ----------------------------------------------------------------------------------

Proxy::Proxy(ProxyConfig config) : impl_(std::make_unique<Impl>(std::move(config))) {}
Proxy::~Proxy() {
  if (impl_ && !impl_->stopping.load()) {
    impl_->stopping.store(true);
    impl_->server->stop(0);
  }
}

void Proxy::start() {
  auto& I = *impl_;
  I.bootstrap_registry();  // before the first request and the first re-sync
  I.server->start();
  for (std::size_t r = 0; r < I.replicas.size(); ++r) I.server->spawn([&I, r] { return I.health_loop(static_cast<int>(r)); });
  if (I.cfg.reconcile_interval > 0) I.server->spawn([&I] { return I.reconcile_loop(); });
  if (I.cfg.stats_log_interval > 0) I.server->spawn([&I] { return I.stats_log_loop(); });
  LS_LOG_INFO("proxy", "listening on {}:{} in front of {} replicas ({} threads)", I.cfg.host, I.server->port(),
              I.replicas.size(), I.cfg.threads);
}

std::uint16_t Proxy::port() const { return impl_->server->port(); }

void Proxy::stop() {
  impl_->stopping.store(true);
  for (auto& rep : impl_->replicas) rep->changed.notify_all();  // the health loops end
  impl_->server->stop(impl_->cfg.shutdown_grace);
}

void Proxy::wait() { impl_->server->wait(); }
nlohmann::json Proxy::stats() const { return impl_->stats_json(); }
std::string Proxy::metrics() const { return impl_->metrics_text(); }

}  // namespace lorasync::proxy
