// Adapter push through the proxy (proxy.md §2.1, docs/http-api.md "Adapter push"): the trainer
// sends an adapter version's bytes once; the proxy prepares it on every in-service replica, and
// only when all have prepared makes the name visible everywhere (commit). Any refusal or timeout
// before that aborts everywhere and the caller gets the first error. The bundle is kept in the
// registry: a replica that rejoins is re-synced from this copy before it gets traffic.
#include <utility>

#include "core/io/adapter_manifest.h"
#include "proxy/fleet_parts.h"
#include "proxy/proxy_impl.h"
#include "util/error.h"
#include "util/log.h"

namespace lorasync::proxy {

using fleet::for_all;
using fleet::ms_since;

namespace {

bool transport_failure(const TargetResult& t) { return t.outcome == "transport_error" || t.outcome == "timeout"; }

}  // namespace

http::Task<http::Response> Proxy::Impl::handle_push(http::Request& req, const std::string& rid) {
  const auto t0 = Clock::now();
  std::string name, lora_path, refused;
  try {
    // The framing only: each replica verifies the checksums itself, in parallel.
    const auto b = io::parse_adapter_bundle(req.body, false);
    name = b.lora_name;
    lora_path = b.lora_path;
  } catch (const Error& e) {
    refused = std::string("proxy: ") + e.what();
  }
  if (!refused.empty()) {
    metrics.inc("adapter_pushes_total", "result=\"refused\"");
    co_return http::error_response(400, refused, "body");
  }
  auto bundle = std::make_shared<const std::string>(std::move(req.body));
  co_await fleet_lock.lock();
  AsyncMutexHeld locked{fleet_lock};
  fleet::EpochBump bump{*this};  // destroyed before `locked`
  const auto t_locked = Clock::now();

  const int N = static_cast<int>(replicas.size());
  std::vector<TargetResult> res(static_cast<std::size_t>(N));
  const std::vector<int> targets = fleet_targets(res);
  if (targets.empty()) co_return http::error_response(503, "proxy: no replica in service to push " + name, "", "proxy_error");

  http::Headers hdrs = upstream_headers(req, rid);
  hdrs.set("Content-Type", "application/octet-stream");
  const double attempt_to = std::min(cfg.adapter_attempt_timeout, cfg.adapter_load_deadline);

  // Phase 1: prepare everywhere.
  co_await for_all(targets, [&](int r) -> http::Task<void> {
    TargetResult& t = res[static_cast<std::size_t>(r)];
    const auto ts = Clock::now();
    ++t.attempts;
    const http::OutRequest out{"POST", io::kPreparePath, &hdrs, *bundle};
    auto got = co_await control_attempt(r, t, out, attempt_to);
    t.ms = ms_since(ts);
    if (!got) co_return;
    const http::Pool::Full& f = *got;
    t.status = f.status;
    if (f.status == 200) {
      t.outcome = "ok";
      note_success(r);
    } else {
      t.outcome = "failed";
      t.body = redact(f.body).substr(0, 300);
    }
  });
  const double prepare_ms = ms_since(t_locked);

  std::vector<int> prepared;
  const TargetResult* first_fail = nullptr;
  int skipped = N - static_cast<int>(targets.size()), failed = 0;
  for (int r : targets) {
    const TargetResult& t = res[static_cast<std::size_t>(r)];
    if (t.outcome == "ok") prepared.push_back(r);
    else if (transport_failure(t) && !cfg.strict_broadcast) {
      // Unreachable: out of service now, re-synced (from this push's copy) before it serves again.
      eject(r, "adapter_push");
      ++skipped;
    } else {
      ++failed;
      if (!first_fail) first_fail = &t;
    }
  }

  nlohmann::json j = {{"path", std::string(req.path())}, {"adapter", name}, {"total", N}};
  int status = 200;
  std::string error;
  double commit_ms = 0;
  if (first_fail || prepared.empty()) {
    // Abort everywhere it may have been prepared (an ejected replica's slot expires on its own).
    const std::string abort_body = nlohmann::json{{"lora_name", name}}.dump();
    http::Headers ah = upstream_headers(req, rid);
    ah.set("Content-Type", "application/json");
    co_await for_all(prepared, [&](int r) -> http::Task<void> {
      Replica& rep = *replicas[static_cast<std::size_t>(r)];
      auto f = co_await rep.pool->fetch({"POST", io::kAbortPath, &ah, abort_body}, call_options(cfg.control_timeout, nullptr, true), 4096);
      res[static_cast<std::size_t>(r)].rollback = f.error == http::CallError::kNone && f.status == 200 ? "aborted" : "abort_failed";
    });
    if (first_fail) {
      status = first_fail->status ? *first_fail->status : (first_fail->outcome == "timeout" ? 504 : 502);
      error = "proxy: " + replicas[static_cast<std::size_t>(first_fail->index)]->url_str + " refused the push of " + name +
              " (" + (first_fail->status ? std::to_string(*first_fail->status) : first_fail->outcome) + " " +
              http::error_message_of(first_fail->body) + "); aborted on the others";
    } else {
      status = 503;
      error = "proxy: no replica could be reached to push " + name;
    }
    metrics.inc("adapter_pushes_total", "result=\"aborted\"");
  } else {
    // Phase 2: every in-service replica holds the version; make it visible everywhere. Past this
    // point there is no going back: a replica whose commit fails is ejected and re-synced.
    const auto tc = Clock::now();
    const std::string commit_body = nlohmann::json{{"lora_name", name}}.dump();
    http::Headers ch = upstream_headers(req, rid);
    ch.set("Content-Type", "application/json");
    std::vector<int> committed_ok(static_cast<std::size_t>(N), 0);
    co_await for_all(prepared, [&](int r) -> http::Task<void> {
      Replica& rep = *replicas[static_cast<std::size_t>(r)];
      auto f = co_await rep.pool->fetch({"POST", io::kCommitPath, &ch, commit_body}, call_options(cfg.control_timeout, nullptr, true), 4096);
      if (f.error == http::CallError::kNone && f.status == 200) committed_ok[static_cast<std::size_t>(r)] = 1;
      else {
        TargetResult& t = res[static_cast<std::size_t>(r)];
        t.outcome = "commit_failed";
        t.status = f.error == http::CallError::kNone ? std::optional<int>(f.status) : std::nullopt;
        t.body = redact(f.error == http::CallError::kNone ? f.body : f.message).substr(0, 300);
      }
    });
    commit_ms = ms_since(tc);
    int committed = 0;
    for (int r : prepared) {
      if (committed_ok[static_cast<std::size_t>(r)]) ++committed;
      else {
        eject(r, "adapter_commit");
        ++skipped;
      }
    }
    if (committed == 0) {
      status = 502;
      error = "proxy: every replica failed to commit " + name + " after preparing it";
      metrics.inc("adapter_pushes_total", "result=\"commit_failed\"");
    } else {
      std::string load_body;
      if (!lora_path.empty()) load_body = nlohmann::json{{"lora_name", name}, {"lora_path", lora_path}}.dump();
      {
        std::lock_guard lk(fleet_mu);
        std::erase_if(registry, [&](const RegisteredAdapter& a) { return a.name == name; });
        registry.push_back({name, load_body, ++next_seq, bundle});
      }
      router.set_registered(registry_names());
      metrics.inc("adapter_pushes_total", "result=\"ok\"");
    }
    j["succeeded"] = committed;
  }
  if (!j.contains("succeeded")) j["succeeded"] = 0;
  j["failed"] = failed;
  j["skipped"] = skipped;
  j["bytes"] = bundle->size();
  j["phases_ms"] = {{"lock", std::chrono::duration<double, std::milli>(t_locked - t0).count()},
                    {"prepare", prepare_ms}, {"commit", commit_ms}};
  metrics.observe("adapter_push_duration_seconds", "", ms_since(t0) / 1000.0);
  LS_LOG_INFO("proxy", "[{}] push {} ({} bytes): {} in {:.0f} ms (prepare {:.0f}, commit {:.0f})", rid, name, bundle->size(),
              status == 200 ? "ok" : "failed", ms_since(t0), prepare_ms, commit_ms);
  j["ok"] = status == 200;
  j["replicas"] = nlohmann::json::array();
  for (int r = 0; r < N; ++r)
    j["replicas"].push_back(fleet::target_json(res[static_cast<std::size_t>(r)], replicas[static_cast<std::size_t>(r)]->url_str));
  if (status != 200) {
    nlohmann::json e = nlohmann::json::parse(http::openai_error_json(status, redact(error), "", status >= 500 ? "proxy_error" : ""));
    j["error"] = e["error"];
  } else {
    j["error"] = nullptr;
  }
  co_return http::json_response(status, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

}  // namespace lorasync::proxy
