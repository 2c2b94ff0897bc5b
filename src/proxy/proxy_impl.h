// proxy/proxy_impl.h: internal state of Proxy shared by proxy.cpp (request handling), fleet.cpp
// (broadcasts, loads, health, re-sync) and stats.cpp (stats and metrics). Not a public header.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "http/client.h"
#include "http/server.h"
#include "proxy/async_sync.h"
#include "proxy/config.h"
#include "proxy/metrics.h"
#include "proxy/proxy.h"
#include "proxy/router.h"

namespace lorasync::proxy {

using Clock = std::chrono::steady_clock;

enum class ReplicaState : int { kInService = 0, kEjected = 1, kProbing = 2, kSyncing = 3 };
const char* state_name(ReplicaState s);

struct Replica {
  int index = 0;
  http::Url url;
  std::string url_str;
  std::unique_ptr<http::Pool> pool;
  std::atomic<int> state{0};
  std::atomic<int> consecutive_failures{0};
  std::atomic<std::uint64_t> failures{0}, ejections{0};
  // Passes of the replica's health loop (each a wake-up: a probe due, a state change, a failure);
  // in /stats, so a loop that spins instead of sleeping shows as a count, not as CPU time.
  std::atomic<std::uint64_t> health_wakeups{0};
  std::atomic<std::int64_t> inflight_all{0};
  // Health loop fields (touched by the replica's own health coroutine and under mu).
  std::mutex mu;
  int consecutive_ejections = 0;
  Clock::time_point ejected_until{};
  int probe_successes = 0;
  std::vector<std::string> pending_unloads;
  // Set when a routed request found a registered adapter missing (404): reconciliation re-syncs
  // the replica at its next pass.
  std::atomic<bool> needs_resync{false};
  // Announced on every state transition: wakes the replica's health loop.
  Notifier changed;
  // Announced when a routed attempt on this replica releases its load: wakes the decisions that
  // --spill-wait holds for this replica (a release elsewhere cannot bring it back within the bound).
  Notifier load_released;
  ReplicaState get() const { return static_cast<ReplicaState>(state.load()); }
};

struct RegisteredAdapter {
  std::string name;
  std::string body;  // verbatim load body, replayed on re-sync ("" for a push without a lora_path)
  std::uint64_t seq = 0;
  // A pushed version: its bundle, replayed to a replica that re-syncs (push.cpp).
  std::shared_ptr<const std::string> bundle;
};

// Outcome of one call of a broadcast / load / fan-in, for the JSON reply.
struct TargetResult {
  int index = 0;
  std::string outcome = "skipped";  // ok | failed | transport_error | timeout | skipped
  std::optional<int> status;
  int attempts = 0;
  double ms = 0;
  std::string body;      // first 300 bytes, token redacted (not ok only)
  std::string rollback;  // "", ok, failed, kept (the replica held the adapter before this load)
  bool no_adapter_found = false;
  bool already_loaded = false;  // the replica answered 200 with "created": false (lorasync serve)
};

http::Task<void> sleep_for(double seconds);

class Proxy::Impl {
 public:
  explicit Impl(ProxyConfig c);

  ProxyConfig cfg;
  std::string api_key_digest;  // sha256_hex(cfg.api_key), once (empty: no key)
  std::string upstream_authorization;  // "Bearer " + cfg.upstream_token, once (empty: no token; never logged)
  Router router;
  Metrics metrics;
  // Fleet data (under fleet_mu). Declared before the server: a fleet operation's coroutine frame
  // that the io_context destroys at shutdown bumps fleet_epoch on its way out (EpochBump).
  mutable std::mutex fleet_mu;
  // Bumped by every fleet operation (load, unload, pause, ...) before it releases fleet_lock. A
  // re-sync runs without the lock and commits only if no operation ran meanwhile (one that did
  // skipped the syncing replica): otherwise it converges again.
  std::uint64_t fleet_epoch = 0;
  // Declared before the replicas so their pooled sockets are closed while the io_context lives.
  std::unique_ptr<http::Server> server;
  std::vector<std::unique_ptr<Replica>> replicas;
  Clock::time_point started = Clock::now();
  std::atomic<std::uint64_t> retries{0}, client_aborts{0}, rejected{0};
  std::atomic<bool> stopping{false};

  // Fleet state (under fleet_mu; the async lock orders whole operations). The lock's waiters hold
  // timers of the io_context, so it is destroyed before the server; its state outlives it for
  // the frames that still hold it.
  AsyncMutex fleet_lock;
  std::vector<RegisteredAdapter> registry;
  std::uint64_t next_seq = 0;
  std::optional<std::string> pause_target;  // path+query of the fleet pause intent
  // Announced when an adapter's last routed request in flight ends: an unload drains on it.
  Notifier adapter_idle;
  void finish_routed(std::string_view adapter, std::optional<std::uint64_t> cached_tokens) {
    if (router.finish_request(adapter, cached_tokens) == 0) adapter_idle.notify_all();
  }

  // The request path's metric series, looked up once by init_metric_cells (proxy.cpp).
  struct RouteCells {
    Metrics::Counter* ok = nullptr;          // requests_total{route, code="200"}
    Metrics::Histogram* duration = nullptr;  // request_duration_seconds{route}
    Metrics::Histogram* ttfb[2] = {};        // time_to_first_byte_seconds{route, stream=false|true}
  };
  static constexpr const char* kRelayRoutes[3] = {"completions", "chat_completions", "forward"};
  RouteCells route_cells[3];                     // by kRelayRoutes
  std::vector<Metrics::Counter*> routed_cells;   // routed_total{replica}
  Metrics::Histogram* decision_seconds = nullptr;
  Metrics::Counter* decision_cells[kOutcomeCount][kReasonCount] = {};  // route_decisions_total{outcome, reason}
  Metrics::Counter* spill_wait_cells[2] = {};  // spill_waits_total{result="kept"|"spilled"} (--spill-wait)
  void init_metric_cells();

  // proxy.cpp
  http::Task<void> handle(http::Request& req, http::ResponseWriter& w);
  http::Task<void> handle_other(http::Request& req, http::ResponseWriter& w);
  // A request's id held inline: a usable X-Request-Id (at most 128 characters) or 128 random bits
  // in hex. (As a std::string, 32 characters were a heap allocation per request.)
  struct RequestId {
    char buf[128];
    std::uint8_t n = 0;
    std::string_view view() const { return {buf, n}; }
  };
  // `rid` by value: the coroutine keeps its own copy (its caller may return before it ends).
  http::Task<void> handle_relay(http::Request& req, http::ResponseWriter& w, bool routed, RequestId rid);
  static RequestId request_id(const http::Request& req);  // X-Request-Id if usable, else a new one
  bool authorized(const http::Request& req) const;            // the API key, when one is set
  http::Headers upstream_headers(const http::Request& req, const std::string& rid) const;
  std::string redact(std::string s) const;
  http::CallOptions call_options(double total, http::CancelSignal* cancel = nullptr, bool fresh = false) const;
  std::uint64_t in_service_mask() const;

  // fleet.cpp
  http::Task<http::Response> handle_load(const http::Request& req, const std::string& rid);
  http::Task<http::Response> handle_broadcast(const http::Request& req, const std::string& rid);
  http::Task<http::Response> handle_fan_in(const http::Request& req, const std::string& rid);
  // push.cpp: two-phase adapter push (moves the request body into the registry).
  http::Task<http::Response> handle_push(http::Request& req, const std::string& rid);
  http::Task<void> health_loop(int r);
  // Until replica r leaves state `seen` (or the proxy stops), or `until`.
  http::Task<void> state_change_or(int r, ReplicaState seen, Clock::time_point until);
  http::Task<void> reconcile_loop();
  http::Task<void> stats_log_loop();
  // Converges replica r to the fleet's intended state (syncing meanwhile) and puts it in service,
  // or ejects it. Never holds fleet_lock across a call to the replica.
  http::Task<bool> resync(int r);
  http::Task<bool> resync_pass(int r);
  // One control call to replica r (a load, a prepare), counted in flight. On a transport failure
  // it sets t.outcome ("timeout" | "transport_error") and t.body, counts the failure, and returns
  // nullopt; otherwise the answer (t untouched).
  // The replicas a fleet operation targets (every one with strict_broadcast, else those in
  // service); numbers res[r].index.
  std::vector<int> fleet_targets(std::vector<TargetResult>& res) const;
  http::Task<std::optional<http::Pool::Full>> control_attempt(int r, TargetResult& t, const http::OutRequest& out,
                                                              double timeout_s);
  void note_failure(int r, const std::string& kind, bool routed_or_probe);
  void note_success(int r);
  void eject(int r, const std::string& reason);
  void set_state(int r, ReplicaState s, const char* why);
  // The same only if the replica is still in `from`; false (nothing changed) otherwise.
  bool set_state_if(int r, ReplicaState from, ReplicaState to, const char* why);
  void note_transition(int r, ReplicaState old, ReplicaState s, const char* why);  // log, purge
  std::vector<std::string> registry_names() const;
  // At start: the adapters every replica that answers already holds become the registry (a
  // restarted proxy carries on with the fleet as it is; the others are unloaded by reconciliation).
  void bootstrap_registry();

  // stats.cpp
  nlohmann::json stats_json() const;
  std::string metrics_text() const;
};

}  // namespace lorasync::proxy
