// Fleet operations of the proxy: all-or-nothing adapter load with rollback (proxy.md §2.1),
// broadcasts (§2.2), health fan-in (§2.3), the per-replica health state machine (§4.3) and the
// adapter registry with re-sync and reconciliation (§4.4).
#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/this_coro.hpp>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/io/adapter_manifest.h"
#include "proxy/prompt_scan.h"
#include "http/blocking_client.h"
#include "proxy/fleet_parts.h"
#include "proxy/proxy_impl.h"
#include "util/log.h"

namespace lorasync::proxy {

namespace {

using fleet::contains;
using fleet::EpochBump;
using fleet::for_all;
using fleet::ms_since;
using fleet::target_json;

}  // namespace

std::vector<std::string> Proxy::Impl::registry_names() const {
  std::lock_guard lk(fleet_mu);
  std::vector<std::string> n;
  for (const auto& a : registry) n.push_back(a.name);
  return n;
}

void Proxy::Impl::set_state(int r, ReplicaState s, const char* why) {
  Replica& rep = *replicas[static_cast<std::size_t>(r)];
  note_transition(r, static_cast<ReplicaState>(rep.state.exchange(static_cast<int>(s))), s, why);
}

bool Proxy::Impl::set_state_if(int r, ReplicaState from, ReplicaState to, const char* why) {
  int expected = static_cast<int>(from);
  if (!replicas[static_cast<std::size_t>(r)]->state.compare_exchange_strong(expected, static_cast<int>(to))) return false;
  note_transition(r, from, to, why);
  return true;
}

void Proxy::Impl::note_transition(int r, ReplicaState old, ReplicaState s, const char* why) {
  if (old == s) return;
  LS_LOG_INFO("proxy", "replica {} ({}) {} -> {} ({})", r, replicas[static_cast<std::size_t>(r)]->url_str, state_name(old),
              state_name(s), why);
  if (s == ReplicaState::kSyncing || s == ReplicaState::kEjected) router.purge_replica(r);
  replicas[static_cast<std::size_t>(r)]->changed.notify_all();  // the replica's health loop
}

void Proxy::Impl::eject(int r, const std::string& reason) {
  Replica& rep = *replicas[static_cast<std::size_t>(r)];
  {
    std::lock_guard lk(rep.mu);
    if (rep.get() == ReplicaState::kEjected) return;
    ++rep.consecutive_ejections;
    double cool = std::min(60.0, cfg.eject_cooldown * static_cast<double>(1u << std::min(rep.consecutive_ejections - 1, 10)));
    rep.ejected_until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cool));
    rep.probe_successes = 0;
  }
  rep.ejections.fetch_add(1);
  metrics.inc("ejections_total", "replica=\"" + std::to_string(r) + "\",reason=\"" + reason + "\"");
  set_state(r, ReplicaState::kEjected, reason.c_str());
}

void Proxy::Impl::note_failure(int r, const std::string& kind, bool counts) {
  Replica& rep = *replicas[static_cast<std::size_t>(r)];
  rep.failures.fetch_add(1);
  metrics.inc("upstream_failures_total", "replica=\"" + std::to_string(r) + "\",kind=\"" + kind + "\"");
  if (!counts) return;
  int n = rep.consecutive_failures.fetch_add(1) + 1;
  if (n >= cfg.eject_after && rep.get() == ReplicaState::kInService) eject(r, "failures");
}

void Proxy::Impl::note_success(int r) { replicas[static_cast<std::size_t>(r)]->consecutive_failures.store(0); }

// ---- adapter load -----------------------------------------------------------------------------

std::vector<int> Proxy::Impl::fleet_targets(std::vector<TargetResult>& res) const {
  std::vector<int> targets;
  for (std::size_t r = 0; r < res.size(); ++r) {
    res[r].index = static_cast<int>(r);
    if (cfg.strict_broadcast || replicas[r]->get() == ReplicaState::kInService) targets.push_back(static_cast<int>(r));
  }
  return targets;
}

http::Task<std::optional<http::Pool::Full>> Proxy::Impl::control_attempt(int r, TargetResult& t, const http::OutRequest& out,
                                                                        double timeout_s) {
  Replica& rep = *replicas[static_cast<std::size_t>(r)];
  rep.inflight_all.fetch_add(1);
  auto f = co_await rep.pool->fetch(out, call_options(timeout_s, nullptr, true), 64 * 1024);
  rep.inflight_all.fetch_sub(1);
  if (f.error != http::CallError::kNone) {
    t.outcome = http::is_timeout(f.error) ? "timeout" : "transport_error";
    t.body = redact(f.message).substr(0, 300);
    note_failure(r, http::call_error_name(f.error), true);
    co_return std::nullopt;
  }
  co_return std::optional<http::Pool::Full>(std::move(f));
}

http::Task<http::Response> Proxy::Impl::handle_load(const http::Request& req, const std::string& rid) {
  const auto t0 = Clock::now();
  std::string name;
  if (auto e = scan_lora_name(req.body, name))
    co_return http::error_response(400, "proxy: " + e->message, e->param);
  co_await fleet_lock.lock();
  AsyncMutexHeld locked{fleet_lock};
  EpochBump bump{*this};  // destroyed before `locked`

  const int N = static_cast<int>(replicas.size());
  std::vector<TargetResult> res(static_cast<std::size_t>(N));
  const std::vector<int> targets = fleet_targets(res);
  if (targets.empty()) co_return http::error_response(503, "proxy: no replica in service to load " + name, "", "proxy_error");

  const http::Headers hdrs = upstream_headers(req, rid);
  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.adapter_load_deadline));
  co_await for_all(targets, [&](int r) -> http::Task<void> {
    TargetResult& t = res[static_cast<std::size_t>(r)];
    const auto ts = Clock::now();
    for (;;) {
      double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      double attempt_to = std::max(0.001, std::min(cfg.adapter_attempt_timeout, left));
      ++t.attempts;
      const http::OutRequest out{req.method, req.target, &hdrs, req.body};
      auto got = co_await control_attempt(r, t, out, attempt_to);
      if (!got) break;
      const http::Pool::Full& f = *got;
      t.status = f.status;
      if (f.status == 200) {
        t.outcome = "ok";
        // lorasync serve says whether the name was new; a replica that already held it keeps it
        // if the load is rolled back (an idempotent reload must not unload a working adapter).
        auto body = nlohmann::json::parse(f.body, nullptr, false);
        t.already_loaded = body.is_object() && body.contains("created") && body["created"].is_boolean() &&
                           !body["created"].get<bool>();
        note_success(r);
        break;
      }
      if (contains(f.body, "No adapter found") &&
          Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.adapter_retry_interval)) < deadline) {
        co_await sleep_for(cfg.adapter_retry_interval);
        continue;
      }
      t.outcome = "failed";
      t.no_adapter_found = contains(f.body, "No adapter found");
      t.body = redact(f.body).substr(0, 300);
      break;
    }
    t.ms = ms_since(ts);
    LS_LOG_INFO("proxy", "[{}] load {} on replica {}: {} status {} attempts {} {:.0f} ms", rid, name, r, t.outcome,
                t.status ? std::to_string(*t.status) : "-", t.attempts, t.ms);
  });

  int ok = 0, failed = 0, skipped = 0;
  for (int r = 0; r < N; ++r) {
    TargetResult& t = res[static_cast<std::size_t>(r)];
    bool targeted = std::find(targets.begin(), targets.end(), r) != targets.end();
    if (!targeted) {
      ++skipped;
      continue;
    }
    if (t.outcome == "ok") ++ok;
    else if ((t.outcome == "transport_error" || t.outcome == "timeout") && !cfg.strict_broadcast) {
      eject(r, "adapter_load");
      ++skipped;
    } else ++failed;
  }
  nlohmann::json j = {{"path", std::string(req.path())}, {"adapter", name}, {"total", N},
                      {"succeeded", ok}, {"failed", failed}, {"skipped", skipped}};
  int status = 200;
  std::string error;
  if (failed == 0 && ok > 0) {
    {
      std::lock_guard lk(fleet_mu);
      std::erase_if(registry, [&](const RegisteredAdapter& a) { return a.name == name; });
      registry.push_back({name, req.body, ++next_seq});
    }
    router.set_registered(registry_names());
    metrics.inc("adapter_loads_total", "result=\"ok\"");
  } else if (failed == 0) {
    status = 503;
    error = "proxy: every target was skipped loading " + name;
    metrics.inc("adapter_loads_total", "result=\"skipped\"");
  } else {
    // Roll back on the replicas that accepted.
    std::vector<int> accepted;
    for (int r : targets) {
      TargetResult& t = res[static_cast<std::size_t>(r)];
      if (t.outcome != "ok") continue;
      if (t.already_loaded) t.rollback = "kept";  // it had the adapter before this load
      else accepted.push_back(r);
    }
    const std::string unload_body = nlohmann::json{{"lora_name", name}}.dump();
    http::Headers uh = hdrs;
    uh.set("Content-Type", "application/json");
    co_await for_all(accepted, [&](int r) -> http::Task<void> {
      Replica& rep = *replicas[static_cast<std::size_t>(r)];
      auto f = co_await rep.pool->fetch({"POST", "/v1/unload_lora_adapter", &uh, unload_body}, call_options(cfg.control_timeout, nullptr, true), 4096);
      bool good = f.error == http::CallError::kNone && f.status == 200;
      res[static_cast<std::size_t>(r)].rollback = good ? "ok" : "failed";
      if (!good) {
        std::lock_guard lk(rep.mu);
        rep.pending_unloads.push_back(name);
      }
    });
    const TargetResult* first_fail = nullptr;
    for (int r : targets) {
      const auto& t = res[static_cast<std::size_t>(r)];
      if (t.outcome != "ok" && !(cfg.strict_broadcast == false && (t.outcome == "transport_error" || t.outcome == "timeout"))) {
        first_fail = &t;
        break;
      }
    }
    status = first_fail->no_adapter_found ? 504
             : first_fail->status         ? *first_fail->status
             : first_fail->outcome == "timeout" ? 504 : 502;
    error = "proxy: " + std::to_string(failed) + "/" + std::to_string(N) + " servers failed to load " + name +
            "; rolled back on the others. First: " + replicas[static_cast<std::size_t>(first_fail->index)]->url_str + " -> " +
            (first_fail->status ? std::to_string(*first_fail->status) : first_fail->outcome) + " " + first_fail->body;
    metrics.inc("adapter_loads_total", "result=\"rolled_back\"");
  }
  metrics.observe("adapter_load_duration_seconds", "", ms_since(t0) / 1000.0);
  j["ok"] = status == 200;
  j["error"] = error.empty() ? nlohmann::json(nullptr) : nlohmann::json(redact(error));
  j["replicas"] = nlohmann::json::array();
  for (int r = 0; r < N; ++r) j["replicas"].push_back(target_json(res[static_cast<std::size_t>(r)], replicas[static_cast<std::size_t>(r)]->url_str));
  if (status != 200) {
    // OpenAI error shape as well, so clients reading `error.message` see the reason.
    nlohmann::json e = nlohmann::json::parse(http::openai_error_json(status, redact(error), "", status >= 500 ? "proxy_error" : ""));
    j["error"] = e["error"];
    j["error"]["message"] = redact(error);
  }
  co_return http::json_response(status, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

// ---- broadcasts -------------------------------------------------------------------------------

http::Task<http::Response> Proxy::Impl::handle_broadcast(const http::Request& req, const std::string& rid) {
  const std::string path(req.path());
  const bool unload = path == "/v1/unload_lora_adapter";
  std::string name;
  if (unload && req.method == "POST") {
    if (auto e = scan_lora_name(req.body, name)) co_return http::error_response(400, "proxy: " + e->message, e->param);
  }
  co_await fleet_lock.lock();
  AsyncMutexHeld locked{fleet_lock};
  EpochBump bump{*this};  // destroyed before `locked`
  if (unload && !name.empty()) {
    {
      std::lock_guard lk(fleet_mu);
      std::erase_if(registry, [&](const RegisteredAdapter& a) { return a.name == name; });
    }
    router.set_registered(registry_names());
    if (cfg.unload_drain_timeout > 0) {
      auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.unload_drain_timeout));
      // Woken by the end of the adapter's last request in flight (finish_routed), not polled.
      co_await adapter_idle.wait_until([&] { return router.adapter_inflight(name) == 0; }, until);
    }
  }
  if (path == "/pause") {
    std::lock_guard lk(fleet_mu);
    pause_target = req.target;
  } else if (path == "/resume") {
    std::lock_guard lk(fleet_mu);
    pause_target.reset();
  }
  const int N = static_cast<int>(replicas.size());
  std::vector<TargetResult> res(static_cast<std::size_t>(N));
  const std::vector<int> targets = fleet_targets(res);
  const http::Headers hdrs = upstream_headers(req, rid);
  co_await for_all(targets, [&](int r) -> http::Task<void> {
    TargetResult& t = res[static_cast<std::size_t>(r)];
    Replica& rep = *replicas[static_cast<std::size_t>(r)];
    const auto ts = Clock::now();
    t.attempts = 1;
    auto f = co_await rep.pool->fetch({req.method, req.target, &hdrs, req.body}, call_options(cfg.control_timeout, nullptr, true), 64 * 1024);
    t.ms = ms_since(ts);
    if (f.error != http::CallError::kNone) {
      t.outcome = http::is_timeout(f.error) ? "timeout" : "transport_error";
      t.body = redact(f.message).substr(0, 300);
      note_failure(r, http::call_error_name(f.error), true);
    } else {
      t.status = f.status;
      t.outcome = f.status == 200 ? "ok" : "failed";
      if (f.status != 200) t.body = redact(f.body).substr(0, 300);
    }
    if (unload && !name.empty() && t.outcome != "ok" && !(t.status && *t.status == 404)) {
      std::lock_guard lk(rep.mu);
      rep.pending_unloads.push_back(name);
    }
    if (path == "/reset_prefix_cache" && t.outcome == "ok") router.purge_replica(r);
  });
  int ok = 0, failed = 0, skipped = N - static_cast<int>(targets.size());
  const TargetResult* first_fail = nullptr;
  for (int r : targets) {
    const auto& t = res[static_cast<std::size_t>(r)];
    if (t.outcome == "ok") ++ok;
    else {
      ++failed;
      if (!first_fail) first_fail = &t;
    }
  }
  int status = 200;
  std::string error;
  if (!unload && first_fail) {
    status = first_fail->status ? *first_fail->status : (first_fail->outcome == "timeout" ? 504 : 502);
    error = "proxy: " + std::to_string(failed) + "/" + std::to_string(N) + " servers failed " + path + ". First: " +
            replicas[static_cast<std::size_t>(first_fail->index)]->url_str + " -> " +
            (first_fail->status ? std::to_string(*first_fail->status) : first_fail->outcome) + " " + first_fail->body;
  }
  nlohmann::json j = {{"ok", status == 200}, {"path", path}, {"total", N}, {"succeeded", ok}, {"failed", failed}, {"skipped", skipped}};
  if (unload) j["adapter"] = name;
  j["error"] = error.empty() ? nlohmann::json(nullptr) : nlohmann::json(redact(error));
  j["replicas"] = nlohmann::json::array();
  for (int r = 0; r < N; ++r) j["replicas"].push_back(target_json(res[static_cast<std::size_t>(r)], replicas[static_cast<std::size_t>(r)]->url_str));
  co_return http::json_response(status, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

// ---- health fan-in ----------------------------------------------------------------------------

http::Task<http::Response> Proxy::Impl::handle_fan_in(const http::Request& req, const std::string& rid) {
  const int N = static_cast<int>(replicas.size());
  std::vector<TargetResult> res(static_cast<std::size_t>(N));
  std::vector<int> all;
  for (int r = 0; r < N; ++r) {
    all.push_back(r);
    res[static_cast<std::size_t>(r)].index = r;
  }
  const http::Headers hdrs = upstream_headers(req, rid);
  co_await for_all(all, [&](int r) -> http::Task<void> {
    TargetResult& t = res[static_cast<std::size_t>(r)];
    const auto ts = Clock::now();
    t.attempts = 1;
    auto f = co_await replicas[static_cast<std::size_t>(r)]->pool->fetch({req.method, req.target, &hdrs, req.body},
                                                                        call_options(cfg.probe_timeout, nullptr, false), 4096);
    t.ms = ms_since(ts);
    if (f.error != http::CallError::kNone) {
      t.outcome = http::is_timeout(f.error) ? "timeout" : "transport_error";
      t.body = redact(f.message).substr(0, 300);
    } else {
      t.status = f.status;
      t.outcome = f.status == 200 ? "ok" : "failed";
      if (f.status != 200) t.body = redact(f.body).substr(0, 300);
    }
  });
  int ok = 0;
  const TargetResult* first_fail = nullptr;
  for (const auto& t : res) {
    if (t.outcome == "ok") ++ok;
    else if (!first_fail) first_fail = &t;
  }
  const int quorum = cfg.health_quorum == 0 ? N : static_cast<int>(cfg.health_quorum);
  int status = 200;
  std::string error;
  if (ok < quorum) {
    status = first_fail->status ? *first_fail->status : 502;
    error = "proxy: " + std::to_string(N - ok) + "/" + std::to_string(N) + " servers unhealthy; first: " +
            replicas[static_cast<std::size_t>(first_fail->index)]->url_str + " -> " +
            (first_fail->status ? std::to_string(*first_fail->status) : first_fail->outcome);
  }
  nlohmann::json j = {{"ok", status == 200}, {"path", std::string(req.path())}, {"total", N}, {"succeeded", ok},
                      {"failed", N - ok}, {"skipped", 0}};
  j["error"] = error.empty() ? nlohmann::json(nullptr) : nlohmann::json(redact(error));
  j["replicas"] = nlohmann::json::array();
  for (int r = 0; r < N; ++r) j["replicas"].push_back(target_json(res[static_cast<std::size_t>(r)], replicas[static_cast<std::size_t>(r)]->url_str));
  co_return http::json_response(status, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

// ---- registry bootstrap (a restarted proxy) -------------------------------------------------------

namespace {

struct HeldAdapter {
  std::string name, root;  // root: the adapter's path as the replica reports it ("" if none)
};

// The adapters (entries with a parent, not the base model) of a `/v1/models` answer; nullopt when
// the body is not that shape.
std::optional<std::vector<HeldAdapter>> adapters_in_models(const std::string& body) {
  std::vector<HeldAdapter> out;
  try {
    auto j = nlohmann::json::parse(body);
    for (const auto& m : j.at("data")) {
      if (!m.is_object() || !m.contains("id") || !m["id"].is_string()) continue;
      if (!m.contains("parent") || m["parent"].is_null()) continue;  // the base model
      out.push_back({m["id"].get<std::string>(), m.contains("root") && m["root"].is_string() ? m["root"].get<std::string>() : ""});
    }
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return out;
}

}  // namespace

void Proxy::Impl::bootstrap_registry() {
  // Adapters held by every replica that answers (vLLM and lorasync serve report the path as `root`).
  std::optional<std::vector<HeldAdapter>> common;
  int answered = 0;
  for (const auto& rp : replicas) {
    http::Pool::Full f;
    try {
      http::BlockingClient c(rp->url_str, cfg.upstream_token);
      f = c.request("GET", "/v1/models", {}, cfg.control_timeout);
    } catch (const std::exception& e) {
      LS_LOG_WARN("proxy", "registry bootstrap: replica {}: {}", rp->index, e.what());
      continue;
    }
    if (f.status != 200) continue;
    auto held = adapters_in_models(f.body);
    if (!held) continue;
    ++answered;
    if (!common) {
      common = std::move(held);
    } else {
      std::erase_if(*common, [&](const HeldAdapter& a) {
        return std::none_of(held->begin(), held->end(), [&](const HeldAdapter& h) { return h.name == a.name; });
      });
    }
  }
  if (!common || common->empty()) return;
  {
    std::lock_guard lk(fleet_mu);
    for (const auto& a : *common)
      registry.push_back({a.name, nlohmann::json{{"lora_name", a.name}, {"lora_path", a.root}}.dump(), ++next_seq});
  }
  router.set_registered(registry_names());
  std::vector<std::string> names;
  for (const auto& a : *common) names.push_back(a.name);
  LS_LOG_INFO("proxy", "adapter registry rebuilt from {} replica(s): {}", answered, fmt::join(names, ", "));
}

// ---- health state machine, re-sync, reconciliation ---------------------------------------------

http::Task<bool> Proxy::Impl::resync(int r) {
  Replica& rep = *replicas[static_cast<std::size_t>(r)];
  set_state(r, ReplicaState::kSyncing, "re-sync");
  router.purge_replica(r);
  bool ok = false;
  for (int pass = 0; pass < 4 && !stopping.load(); ++pass) {
    std::uint64_t epoch0;
    {
      std::lock_guard lk(fleet_mu);
      epoch0 = fleet_epoch;
    }
    ok = co_await resync_pass(r);  // slow: loads, unloads, pause; no fleet lock held
    if (!ok) break;
    // Commit under the fleet lock, held for this check only: an operation that ran meanwhile
    // skipped this replica (it was syncing), so converge again.
    co_await fleet_lock.lock();
    AsyncMutexHeld locked{fleet_lock};
    {
      std::lock_guard lk(fleet_mu);
      if (fleet_epoch != epoch0) {
        ok = false;
        continue;
      }
    }
    // Ejected meanwhile (from any state): it stays out; its next re-sync starts over.
    const std::string why = pass ? fmt::format("re-synced in {} passes", pass + 1) : std::string("re-synced");
    if (!set_state_if(r, ReplicaState::kSyncing, ReplicaState::kInService, why.c_str())) {
      ok = false;
      break;
    }
    {
      std::lock_guard lk(rep.mu);
      rep.consecutive_ejections = 0;
    }
    rep.consecutive_failures.store(0);
    break;
  }
  metrics.inc("resyncs_total", "replica=\"" + std::to_string(r) + "\",result=\"" + (ok ? "ok" : "failed") + "\"");
  if (!ok) eject(r, "resync_failed");
  co_return ok;
}

http::Task<bool> Proxy::Impl::resync_pass(int r) {
  Replica& rep = *replicas[static_cast<std::size_t>(r)];
  http::Headers h;
  h.add("Content-Type", "application/json");
  if (!cfg.upstream_token.empty()) h.add("Authorization", "Bearer " + cfg.upstream_token);
  bool ok = true;
  std::vector<std::string> pending;
  {
    std::lock_guard lk(rep.mu);
    pending.swap(rep.pending_unloads);
  }
  std::vector<std::string> still;
  for (const auto& name : pending) {
    std::string body = nlohmann::json{{"lora_name", name}}.dump();
    auto f = co_await rep.pool->fetch({"POST", "/v1/unload_lora_adapter", &h, body}, call_options(cfg.control_timeout, nullptr, true));
    if (f.error != http::CallError::kNone || (f.status != 200 && f.status != 404)) still.push_back(name);
  }
  {
    std::lock_guard lk(rep.mu);
    rep.pending_unloads.insert(rep.pending_unloads.end(), still.begin(), still.end());
  }
  std::vector<RegisteredAdapter> loads;
  std::optional<std::string> pause;
  {
    std::lock_guard lk(fleet_mu);
    loads = registry;
    pause = pause_target;
  }
  http::Headers hb = h;
  hb.set("Content-Type", "application/octet-stream");
  for (const auto& a : loads) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.adapter_load_deadline));
    bool done = false;
    while (!done) {
      double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      // A pushed version is replayed from the proxy's copy (one phase: the replica is not in
      // service), a path load from its body.
      // (Locals: no conditional expression inside a co_await argument, g++ 12.)
      const bool push = a.bundle != nullptr;
      const std::string_view target = push ? io::kPushPath : std::string_view("/v1/load_lora_adapter");
      const http::Headers* headers = push ? &hb : &h;
      const std::string_view body = push ? std::string_view(*a.bundle) : std::string_view(a.body);
      const http::OutRequest out{"POST", target, headers, body};
      auto f = co_await rep.pool->fetch(out,
                                        call_options(std::max(0.001, std::min(cfg.adapter_attempt_timeout, left)), nullptr, true));
      if (f.error == http::CallError::kNone && (f.status == 200 || (f.status == 400 && contains(f.body, "already been loaded")))) {
        done = true;
      } else if (f.error == http::CallError::kNone && contains(f.body, "No adapter found") &&
                 std::chrono::duration<double>(deadline - Clock::now()).count() > cfg.adapter_retry_interval) {
        co_await sleep_for(cfg.adapter_retry_interval);
      } else {
        LS_LOG_WARN("proxy", "re-sync of replica {}: load {} failed ({})", r, a.name,
                    f.error != http::CallError::kNone ? redact(f.message) : std::to_string(f.status));
        ok = false;
        break;
      }
    }
    if (!ok) break;
  }
  // Adapters the replica holds that the fleet does not (an unload it missed while out of service,
  // a load rolled back elsewhere): unloaded, so the replica converges to exactly the registry.
  if (ok) {
    auto f = co_await rep.pool->fetch({"GET", "/v1/models", &h, ""}, call_options(cfg.control_timeout, nullptr, true), 4 << 20);
    if (f.error == http::CallError::kNone && f.status == 200) {
      std::vector<std::string> extra;
      for (const auto& held : adapters_in_models(f.body).value_or(std::vector<HeldAdapter>{}))
        if (std::none_of(loads.begin(), loads.end(), [&](const RegisteredAdapter& a) { return a.name == held.name; }))
          extra.push_back(held.name);
      for (const auto& name : extra) {
        std::string body = nlohmann::json{{"lora_name", name}}.dump();
        auto u = co_await rep.pool->fetch({"POST", "/v1/unload_lora_adapter", &h, body}, call_options(cfg.control_timeout, nullptr, true));
        const bool gone = u.error == http::CallError::kNone && (u.status == 200 || u.status == 404);
        LS_LOG_INFO("proxy", "re-sync of replica {}: unloaded {} (not registered){}", r, name, gone ? "" : ": failed");
        if (!gone) ok = false;
      }
    }
  }
  // The fleet's pause state, either way: a replica that missed a /resume while out of service
  // must not rejoin paused. (A replica without /resume answers 404: nothing to undo.)
  if (ok) {
    const std::string target = pause ? *pause : std::string("/resume");
    auto f = co_await rep.pool->fetch({"POST", target, &h, ""}, call_options(cfg.control_timeout, nullptr, true));
    ok = f.error == http::CallError::kNone && (f.status == 200 || (!pause && f.status == 404));
  }
  co_return ok;
}

http::Task<void> Proxy::Impl::health_loop(int r) {
  Replica& rep = *replicas[static_cast<std::size_t>(r)];
  http::Headers h;
  if (!cfg.upstream_token.empty()) h.add("Authorization", "Bearer " + cfg.upstream_token);
  auto next_probe = Clock::now();
  const auto interval = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.probe_interval));
  while (!stopping.load()) {
    rep.health_wakeups.fetch_add(1, std::memory_order_relaxed);
    bool failed = false;
    try {
    ReplicaState s = rep.get();
    if (s == ReplicaState::kEjected) {
      Clock::time_point until;
      {
        std::lock_guard lk(rep.mu);
        until = rep.ejected_until;
      }
      if (Clock::now() >= until) {
        set_state(r, ReplicaState::kProbing, "cooldown over");
        next_probe = Clock::now();
      } else {
        co_await state_change_or(r, ReplicaState::kEjected, until);
        continue;
      }
    }
    s = rep.get();
    if ((s == ReplicaState::kInService || s == ReplicaState::kProbing) && Clock::now() >= next_probe) {
      next_probe = Clock::now() + interval;
      auto f = co_await rep.pool->fetch({"GET", "/health", &h, ""}, call_options(cfg.probe_timeout), 4096);
      bool good = f.error == http::CallError::kNone && f.status < 500;
      bool healthy = f.error == http::CallError::kNone && f.status == 200;
      if (f.error == http::CallError::kLocal) {
        // The proxy's own shortage says nothing about the replica.
        LS_LOG_WARN("proxy", "health probe of replica {} could not be sent: {}", r, f.message);
      } else if (rep.get() == ReplicaState::kInService) {
        if (good) note_success(r);
        else note_failure(r, f.error != http::CallError::kNone ? http::call_error_name(f.error) : "probe_status", true);
      } else if (rep.get() == ReplicaState::kProbing) {
        if (!healthy) {
          eject(r, "probe_failed");
        } else {
          int n;
          {
            std::lock_guard lk(rep.mu);
            n = ++rep.probe_successes;
          }
          if (n >= cfg.recover_after) {
            co_await resync(r);
          } else {
            next_probe = Clock::now() + std::min(interval, std::chrono::duration_cast<Clock::duration>(std::chrono::milliseconds(200)));
          }
        }
      }
    }
    } catch (const std::exception& e) {
      // The loop outlives any one failure: a replica must never stop being probed.
      LS_LOG_ERROR("proxy", "health check of replica {} failed: {}", r, e.what());
      failed = true;
    }
    // Asleep until the next probe is due (after a failure: 0.5 s; while the replica syncs: until
    // the re-sync ends), woken early by any transition of the replica's state (an ejection seen on
    // client traffic, the end of a re-sync). Ejected meanwhile (by its own probe): the top of the
    // loop waits out the cooldown, as only this loop ends it.
    const ReplicaState seen = rep.get();
    if (!failed && seen == ReplicaState::kEjected) continue;
    Clock::time_point due = next_probe;
    if (failed) due = Clock::now() + std::chrono::milliseconds(500);
    else if (seen == ReplicaState::kSyncing) due = Clock::time_point::max();
    co_await state_change_or(r, seen, due);
  }
}

http::Task<void> Proxy::Impl::state_change_or(int r, ReplicaState seen, Clock::time_point until) {
  Replica& rep = *replicas[static_cast<std::size_t>(r)];
  co_await rep.changed.wait_until([&] { return stopping.load() || rep.get() != seen; }, until);
}

http::Task<void> Proxy::Impl::reconcile_loop() {
  http::Headers h;
  if (!cfg.upstream_token.empty()) h.add("Authorization", "Bearer " + cfg.upstream_token);
  while (!stopping.load()) {
    co_await sleep_for(cfg.reconcile_interval);
    if (stopping.load()) continue;
    // A background loop outlives any one failure (a malformed answer, an allocation failure):
    // log it and carry on at the next interval.
    std::vector<int> todo;
    try {
      // Detection under the fleet lock (no load or unload half done); the re-syncs after it.
      if (!fleet_lock.try_lock()) continue;
      AsyncMutexHeld locked{fleet_lock};
      auto names = registry_names();
      for (auto& rp : replicas) {
        if (rp->get() != ReplicaState::kInService) continue;
        if (rp->needs_resync.exchange(false)) {
          LS_LOG_WARN("proxy", "replica {} answered 404 for a registered adapter; re-syncing", rp->index);
          todo.push_back(rp->index);
          continue;
        }
        auto f = co_await rp->pool->fetch({"GET", "/v1/models", &h, ""}, call_options(cfg.control_timeout), 4 << 20);
        if (f.error != http::CallError::kNone || f.status != 200) continue;
        auto held = adapters_in_models(f.body);
        if (!held) continue;
        std::vector<std::string> adapters;
        for (const auto& a : *held) adapters.push_back(a.name);
        // Converge both ways: registered adapters present, unregistered ones absent.
        bool has_pending;
        {
          std::lock_guard lk(rp->mu);
          has_pending = !rp->pending_unloads.empty();
        }
        bool missing = false, extra = has_pending;
        for (const auto& n : names) missing |= std::find(adapters.begin(), adapters.end(), n) == adapters.end();
        for (const auto& a : adapters) extra |= std::find(names.begin(), names.end(), a) == names.end();
        if (missing || extra) {
          LS_LOG_WARN("proxy", "replica {} {}; re-syncing", rp->index,
                      missing ? "lost registered adapters" : "holds adapters the fleet unloaded");
          todo.push_back(rp->index);
        }
      }
    } catch (const std::exception& e) {
      LS_LOG_ERROR("proxy", "reconciliation pass failed: {}", e.what());
      continue;
    }
    if (!todo.empty()) co_await for_all(todo, [this](int r) -> http::Task<void> { co_await resync(r); });
  }
}

http::Task<void> Proxy::Impl::stats_log_loop() {
  std::uint64_t last = 0;
  while (!stopping.load()) {
    co_await sleep_for(cfg.stats_log_interval);
    auto s = router.snapshot();
    if (s.routed == last) continue;
    last = s.routed;
    LS_LOG_INFO("proxy", "routed {} affinity {} spilled {} unmatched {} tracked_blocks {} retries {} client_aborts {}", s.routed,
                s.affinity, s.spilled, s.unmatched, s.tracked_blocks, retries.load(), client_aborts.load());
  }
}

}  // namespace lorasync::proxy
