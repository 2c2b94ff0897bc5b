// GET /proxy/stats (proxy.md §2.4) and GET /metrics (§4.8).
#include <algorithm>
#include <cmath>

#include "proxy/proxy_impl.h"

namespace lorasync::proxy {

const std::vector<double>& histogram_bounds() {
  static const std::vector<double> b = [] {
    std::vector<double> v;
    for (double x = 0.0005; x <= 600.0 * 1.0001; x *= 2.5) v.push_back(x);
    if (v.back() < 600.0) v.push_back(600.0);
    return v;
  }();
  return b;
}

namespace {
template <typename T, typename M>
T& cell_of(std::mutex& mu, M& series, std::string_view name, std::string_view labels) {
  std::lock_guard lk(mu);
  auto it = series.find(name);
  if (it == series.end()) it = series.emplace(std::string(name), typename M::mapped_type{}).first;
  auto jt = it->second.find(labels);
  if (jt == it->second.end()) jt = it->second.emplace(std::string(labels), std::make_unique<T>()).first;
  return *jt->second;
}
}  // namespace

Metrics::Counter& Metrics::counter_cell(std::string_view name, std::string_view labels) {
  return cell_of<Counter>(mu_, counters_, name, labels);
}

Metrics::Histogram& Metrics::histogram_cell(std::string_view name, std::string_view labels) {
  return cell_of<Histogram>(mu_, hists_, name, labels);
}

void Metrics::Histogram::observe(double v) {
  const auto& b = histogram_bounds();
  const auto i = static_cast<std::size_t>(std::lower_bound(b.begin(), b.end(), v) - b.begin());
  if (i < b.size()) buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

double Metrics::counter(std::string_view name, std::string_view labels) const {
  std::lock_guard lk(mu_);
  auto it = counters_.find(name);
  if (it == counters_.end()) return 0;
  auto jt = it->second.find(labels);
  return jt == it->second.end() ? 0 : jt->second->value();
}

namespace {
std::string num(double v) {
  if (std::isinf(v)) return "+Inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
std::string with(const std::string& labels, const std::string& extra) {
  if (labels.empty()) return "{" + extra + "}";
  return "{" + labels + "," + extra + "}";
}
std::string lbl(const std::string& labels) { return labels.empty() ? "" : "{" + labels + "}"; }
std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}
}  // namespace

void Metrics::render(std::string& out, const std::string& prefix) const {
  const auto& b = histogram_bounds();
  std::lock_guard lk(mu_);
  for (const auto& [name, series] : counters_) {
    out += "# TYPE " + prefix + name + " counter\n";
    for (const auto& [labels, v] : series) out += prefix + name + lbl(labels) + " " + num(v->value()) + "\n";
  }
  for (const auto& [name, series] : hists_) {
    out += "# TYPE " + prefix + name + " histogram\n";
    for (const auto& [labels, hp] : series) {
      const Histogram& h = *hp;
      std::uint64_t cum = 0;
      for (std::size_t i = 0; i < b.size(); ++i) {
        cum += h.bucket(i);
        out += prefix + name + "_bucket" + with(labels, "le=\"" + num(b[i]) + "\"") + " " + std::to_string(cum) + "\n";
      }
      const std::uint64_t count = std::max(cum, h.count());  // never below its buckets
      out += prefix + name + "_bucket" + with(labels, "le=\"+Inf\"") + " " + std::to_string(count) + "\n";
      out += prefix + name + "_sum" + lbl(labels) + " " + num(h.sum()) + "\n";
      out += prefix + name + "_count" + lbl(labels) + " " + std::to_string(count) + "\n";
    }
  }
}

nlohmann::json Proxy::Impl::stats_json() const {
  auto s = router.snapshot();
  nlohmann::json j;
  j["upstreams"] = nlohmann::json::array();
  for (const auto& r : replicas) {
    std::vector<std::string> pending;
    {
      std::lock_guard lk(r->mu);
      pending = r->pending_unloads;
    }
    j["upstreams"].push_back({{"index", r->index}, {"url", r->url_str}, {"state", state_name(r->get())},
                              {"inflight", s.load[static_cast<std::size_t>(r->index)]},
                              {"inflight_all", r->inflight_all.load()},
                              {"routed", s.routed_per_replica[static_cast<std::size_t>(r->index)]},
                              {"failures", r->failures.load()}, {"consecutive_failures", r->consecutive_failures.load()},
                              {"ejections", r->ejections.load()}, {"health_wakeups", r->health_wakeups.load()},
                              {"pending_unloads", pending}});
  }
  j["router"] = {{"routed", s.routed}, {"affinity", s.affinity}, {"spilled", s.spilled}, {"unmatched", s.unmatched},
                 {"tracked_blocks", s.tracked_blocks}, {"evicted_blocks", s.evicted_blocks},
                 {"max_tracked_blocks", cfg.max_tracked_blocks}, {"block_size", cfg.block_size}, {"imbalance", cfg.imbalance}, {"spill_wait", cfg.spill_wait},
                 {"spill_waits_kept", static_cast<std::uint64_t>(spill_wait_cells[0]->value())},
                 {"spill_waits_spilled", static_cast<std::uint64_t>(spill_wait_cells[1]->value())},
                 {"table_bytes", s.table_memory_bytes}};
  auto names = registry_names();
  j["adapters"] = nlohmann::json::array();
  for (const auto& a : s.adapters) {
    bool reg = std::find(names.begin(), names.end(), a.name) != names.end();
    j["adapters"].push_back({{"name", a.name}, {"registered", reg}, {"inflight", a.inflight}, {"routed", a.routed},
                             {"affinity", a.affinity}, {"spilled", a.spilled}, {"unmatched", a.unmatched},
                             {"blocks", a.blocks}, {"blocks_matched", a.blocks_matched},
                             {"cached_tokens", a.cached_tokens ? nlohmann::json(*a.cached_tokens) : nlohmann::json(nullptr)}});
  }
  {
    std::lock_guard lk(fleet_mu);
    j["fleet"] = {{"paused", pause_target.has_value()},
                  {"pause_path", pause_target ? nlohmann::json(*pause_target) : nlohmann::json(nullptr)},
                  {"registry", names}};
  }
  j["proxy"] = {{"version", LORASYNC_VERSION},
                {"uptime_s", std::chrono::duration<double>(Clock::now() - started).count()},
                {"retries", retries.load()}, {"client_aborts", client_aborts.load()}, {"rejected", rejected.load()}};
  return j;
}

std::string Proxy::Impl::metrics_text() const {
  const std::string P = "lorasync_proxy_";
  std::string out;
  out.reserve(16384);
  auto s = router.snapshot();
  out += "# TYPE " + P + "upstream_info gauge\n";
  for (const auto& r : replicas)
    out += P + "upstream_info{replica=\"" + std::to_string(r->index) + "\",url=\"" + esc(r->url_str) + "\"} 1\n";
  out += "# TYPE " + P + "upstream_inflight gauge\n";
  for (const auto& r : replicas)
    out += P + "upstream_inflight{replica=\"" + std::to_string(r->index) + "\"} " + std::to_string(s.load[static_cast<std::size_t>(r->index)]) + "\n";
  out += "# TYPE " + P + "replica_state gauge\n";
  for (const auto& r : replicas)
    for (auto st : {ReplicaState::kInService, ReplicaState::kEjected, ReplicaState::kProbing, ReplicaState::kSyncing})
      out += P + "replica_state{replica=\"" + std::to_string(r->index) + "\",state=\"" + state_name(st) + "\"} " +
             (r->get() == st ? "1" : "0") + "\n";
  out += "# TYPE " + P + "tracked_blocks gauge\n" + P + "tracked_blocks " + std::to_string(s.tracked_blocks) + "\n";
  out += "# TYPE " + P + "max_tracked_blocks gauge\n" + P + "max_tracked_blocks " + std::to_string(cfg.max_tracked_blocks) + "\n";
  out += "# TYPE " + P + "evicted_blocks_total counter\n" + P + "evicted_blocks_total " + std::to_string(s.evicted_blocks) + "\n";
  out += "# TYPE " + P + "adapter_inflight gauge\n";
  for (const auto& a : s.adapters) out += P + "adapter_inflight{adapter=\"" + esc(a.name) + "\"} " + std::to_string(a.inflight) + "\n";
  out += "# TYPE " + P + "adapter_routed_total counter\n";
  for (const auto& a : s.adapters) out += P + "adapter_routed_total{adapter=\"" + esc(a.name) + "\"} " + std::to_string(a.routed) + "\n";
  out += "# TYPE " + P + "prefix_blocks_total counter\n";
  for (const auto& a : s.adapters) {
    out += P + "prefix_blocks_total{adapter=\"" + esc(a.name) + "\",kind=\"requested\"} " + std::to_string(a.blocks) + "\n";
    out += P + "prefix_blocks_total{adapter=\"" + esc(a.name) + "\",kind=\"matched\"} " + std::to_string(a.blocks_matched) + "\n";
  }
  out += "# TYPE " + P + "client_aborts_total counter\n" + P + "client_aborts_total " + std::to_string(client_aborts.load()) + "\n";
  if (server) {
    out += "# TYPE " + P + "open_connections gauge\n" + P + "open_connections " + std::to_string(server->open_connections()) + "\n";
    out += "# TYPE " + P + "max_connections gauge\n" + P + "max_connections " + std::to_string(server->max_connections()) + "\n";
    out += "# TYPE " + P + "connections_refused_total counter\n" + P + "connections_refused_total " +
           std::to_string(server->refused_connections()) + "\n";
  }
  // Metrics holds everything else (requests_total, routed_total, route_decisions_total, ...).
  std::string rest;
  metrics.render(rest, P);
  // client_aborts_total is also counted there; drop the duplicate family.
  std::string filtered;
  std::size_t pos = 0;
  while (pos < rest.size()) {
    std::size_t e = rest.find('\n', pos);
    std::string line = rest.substr(pos, e - pos);
    if (line.find("client_aborts_total") == std::string::npos) filtered += line + "\n";
    pos = e + 1;
  }
  return out + filtered;
}

}  // namespace lorasync::proxy
