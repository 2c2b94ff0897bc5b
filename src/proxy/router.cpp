#include "proxy/router.h"

#include <algorithm>
#include <utility>

#include "util/error.h"

namespace lorasync::proxy {

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::kAffinity: return "affinity";
    case Outcome::kSpilled: return "spilled";
    case Outcome::kUnmatched: return "unmatched";
  }
  return "?";
}

const char* reason_name(Reason r) {
  switch (r) {
    case Reason::kNone: return "none";
    case Reason::kImbalance: return "imbalance";
    case Reason::kOwnerUnavailable: return "owner_unavailable";
    case Reason::kNoBlocks: return "no_blocks";
    case Reason::kCold: return "cold";
    case Reason::kCommonOnly: return "common_only";
  }
  return "?";
}

namespace {
constexpr std::size_t kMaxAdapterNames = 64;
}

Router::Router(RouterOptions opts)
    : opts_(opts),
      all_mask_(opts.n_replicas >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << opts.n_replicas) - 1),
      table_(opts.max_tracked_blocks),
      routed_per_replica_(static_cast<std::size_t>(opts.n_replicas), 0) {
  LS_CHECK(opts.n_replicas >= 1 && opts.n_replicas <= kMaxReplicas, "bad replica count {}", opts.n_replicas);
  for (auto& l : load_) l.store(0);
}

Decision Router::route(std::span<const Hash128> blocks, std::uint64_t eligible, bool first_attempt,
                       std::string_view adapter, bool defer_spill) {
  const int N = opts_.n_replicas;
  eligible &= all_mask_;
  std::lock_guard lk(mu_);
  Decision d;
  if (eligible == 0) return d;

  // 1-2. matched[r] and common over the leading run of known blocks.
  std::uint32_t matched[kMaxReplicas] = {};
  std::uint32_t common = 0;
  std::uint64_t running = all_mask_;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    std::uint32_t s = table_.find(blocks[i]);
    if (s == BlockTable::kNil) break;
    const auto& e = table_.at(s);
    running &= e.owners;
    for (std::uint64_t m = running; m; m &= m - 1) matched[__builtin_ctzll(m)] = static_cast<std::uint32_t>(i + 1);
    if (e.owners == all_mask_ || (e.flags & BlockTable::kBranched)) common = static_cast<std::uint32_t>(i + 1);
  }
  // 3-4. specific, least, best.
  auto specific = [&](int r) { return matched[r] > common ? matched[r] - common : 0u; };
  const std::int64_t least = least_load(eligible);
  int best = -1;
  std::uint32_t best_spec = 0;
  std::int64_t best_load = 0;
  for (int r = 0; r < N; ++r) {
    if (!(eligible >> r & 1)) continue;
    std::uint32_t sp = specific(r);
    std::int64_t l = load_[r].load(std::memory_order_relaxed);
    if (best < 0 || sp > best_spec || (sp == best_spec && l < best_load)) {
      best = r;
      best_spec = sp;
      best_load = l;
    }
  }
  // 5-6.
  if (best_spec > 0 && best_load - least <= opts_.imbalance) {
    d.pick = best;
    d.outcome = Outcome::kAffinity;
  } else {
    bool outside = false;
    for (int r = 0; r < N; ++r)
      if (!(eligible >> r & 1) && specific(r) > 0) outside = true;
    if (best_spec > 0) {
      d.outcome = Outcome::kSpilled;
      d.reason = Reason::kImbalance;
      if (defer_spill) {
        d.pick = best;
        d.matched = matched[best];
        d.deferred = true;
        return d;
      }
    } else if (outside) {
      d.outcome = Outcome::kSpilled;
      d.reason = Reason::kOwnerUnavailable;
    } else {
      d.outcome = Outcome::kUnmatched;
      bool any = false;
      for (int r = 0; r < N; ++r) any |= matched[r] > 0;
      d.reason = blocks.empty() ? Reason::kNoBlocks : (!any ? Reason::kCold : Reason::kCommonOnly);
    }
    for (int k = 0; k < N; ++k) {
      int r = (cursor_ + k) % N;
      if ((eligible >> r & 1) && load_[r].load(std::memory_order_relaxed) == least) {
        d.pick = r;
        break;
      }
    }
    cursor_ = (d.pick + 1) % N;
  }
  d.matched = matched[d.pick];

  // 7. Record, evict, count.
  const std::uint64_t bit = std::uint64_t{1} << d.pick;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    std::uint32_t s = table_.find_or_insert(blocks[i]);
    table_.at(s).owners |= bit;
    if (i + 1 < blocks.size()) table_.feed_successor(s, blocks[i + 1].fingerprint());
    table_.touch(s);
  }
  evicted_ += table_.evict_to_bound();
  load_[d.pick].fetch_add(1, std::memory_order_relaxed);
  ++routed_per_replica_[d.pick];
  if (first_attempt) {
    ++routed_;
    ++outcomes_[static_cast<int>(d.outcome)];
    ++decisions_[static_cast<int>(d.outcome)][static_cast<int>(d.reason)];
    AdapterStats& a = adapter_locked(adapter);
    ++a.inflight;
    ++a.routed;
    if (d.outcome == Outcome::kAffinity) ++a.affinity;
    else if (d.outcome == Outcome::kSpilled) ++a.spilled;
    else ++a.unmatched;
    a.blocks += blocks.size();
    a.blocks_matched += d.matched;
  }
  return d;
}

void Router::release(int replica) { load_[replica].fetch_sub(1, std::memory_order_relaxed); }

std::int64_t Router::least_load(std::uint64_t eligible) const {
  std::int64_t least = INT64_MAX;
  for (std::uint64_t m = eligible; m; m &= m - 1)
    least = std::min(least, load_[__builtin_ctzll(m)].load(std::memory_order_relaxed));
  return least;
}

bool Router::within_imbalance(int replica, std::uint64_t eligible) const {
  eligible &= all_mask_;
  if (!(eligible >> replica & 1)) return false;
  return load_[replica].load(std::memory_order_relaxed) - least_load(eligible) <= opts_.imbalance;
}

const AdapterStats* Router::find_adapter_locked(std::string_view name) const {
  // Newest first: the adapter being trained is the last name added, and a run advances through
  // dozens of versions whose names differ only near their ends.
  for (auto it = adapters_.rbegin(); it != adapters_.rend(); ++it)
    if (it->name == name) return &*it;
  return nullptr;
}

AdapterStats* Router::find_adapter_locked(std::string_view name) {
  return const_cast<AdapterStats*>(std::as_const(*this).find_adapter_locked(name));
}

AdapterStats& Router::adapter_locked(std::string_view name) {
  if (AdapterStats* a = find_adapter_locked(name)) {
    a->last_use = ++use_clock_;
    return *a;
  }
  if (adapters_.size() >= kMaxAdapterNames) {
    // Drop the least recently used unregistered name with nothing in flight.
    int victim = -1;
    for (std::size_t i = 0; i < adapters_.size(); ++i) {
      const auto& a = adapters_[i];
      if (a.inflight != 0) continue;
      if (std::find(registered_.begin(), registered_.end(), a.name) != registered_.end()) continue;
      if (victim < 0 || a.last_use < adapters_[static_cast<std::size_t>(victim)].last_use) victim = static_cast<int>(i);
    }
    if (victim >= 0) adapters_.erase(adapters_.begin() + victim);
  }
  AdapterStats a;
  a.name = std::string(name);
  a.last_use = ++use_clock_;
  adapters_.push_back(std::move(a));
  return adapters_.back();
}

std::int64_t Router::finish_request(std::string_view adapter, std::optional<std::uint64_t> cached_tokens) {
  std::lock_guard lk(mu_);
  AdapterStats* a = find_adapter_locked(adapter);
  if (!a) return 0;
  if (a->inflight > 0) --a->inflight;
  if (cached_tokens) a->cached_tokens = a->cached_tokens.value_or(0) + *cached_tokens;
  return a->inflight;
}

std::size_t Router::purge_replica(int replica) {
  std::lock_guard lk(mu_);
  return table_.purge_replica(replica);
}

void Router::set_registered(std::vector<std::string> names) {
  std::lock_guard lk(mu_);
  registered_ = std::move(names);
}

std::int64_t Router::adapter_inflight(std::string_view adapter) const {
  std::lock_guard lk(mu_);
  const AdapterStats* a = find_adapter_locked(adapter);
  return a ? a->inflight : 0;
}

RouterSnapshot Router::snapshot() const {
  std::lock_guard lk(mu_);
  RouterSnapshot s;
  s.routed = routed_;
  s.affinity = outcomes_[0];
  s.spilled = outcomes_[1];
  s.unmatched = outcomes_[2];
  s.tracked_blocks = table_.size();
  s.evicted_blocks = evicted_;
  s.routed_per_replica = routed_per_replica_;
  for (int r = 0; r < opts_.n_replicas; ++r) s.load.push_back(load_[r].load());
  s.decisions = decisions_;
  s.adapters = adapters_;
  s.table_memory_bytes = table_.memory_bytes();
  return s;
}

}  // namespace lorasync::proxy
