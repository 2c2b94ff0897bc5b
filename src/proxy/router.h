// proxy/router.h: the prefix-affinity decision of proxy.md §3.4 and its counters.
//
// route() is one atomic section under a mutex: decision (matched / common / specific / least
// load / cursor), recording of ownership, LRU eviction, load increment and counters. Hashing
// happens before, outside the lock (prompt_scan.h). release() decrements load atomically.
// Per-adapter accounting (§4.6) shares the same mutex; at most 64 names are tracked.
//
// Decisions depend only on request order and in-flight counts, so a sequence of requests sent one
// at a time gives the same picks and counters as the reference proxy.
// Thread-safety: every public member is thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "proxy/block_table.h"

namespace lorasync::proxy {

inline constexpr int kMaxReplicas = 64;

enum class Outcome : std::uint8_t { kAffinity, kSpilled, kUnmatched };
enum class Reason : std::uint8_t { kNone, kImbalance, kOwnerUnavailable, kNoBlocks, kCold, kCommonOnly };
inline constexpr int kOutcomeCount = 3;  // values of Outcome
inline constexpr int kReasonCount = 6;   // values of Reason
const char* outcome_name(Outcome o);
const char* reason_name(Reason r);

struct RouterOptions {
  int n_replicas = 2;                  // configured replicas (<= 64)
  std::size_t max_tracked_blocks = 500000;
  std::int64_t imbalance = 8;
  std::size_t block_size = 16;         // reported only; hashing uses it
};

struct Decision {
  int pick = -1;                 // -1: no eligible replica
  Outcome outcome = Outcome::kUnmatched;
  Reason reason = Reason::kNone;
  std::uint32_t matched = 0;     // matched[pick]: the predicted prefix hit in blocks
  // route(..., defer_spill = true) met a spill for imbalance and did not take it: nothing was
  // recorded or counted; pick is the replica holding the request's blocks (the one to wait for).
  bool deferred = false;
};

struct AdapterStats {
  std::string name;
  std::int64_t inflight = 0;
  std::uint64_t routed = 0, affinity = 0, spilled = 0, unmatched = 0;
  std::uint64_t blocks = 0, blocks_matched = 0;
  std::optional<std::uint64_t> cached_tokens;  // summed replica-reported prefix hits
  std::uint64_t last_use = 0;
};

struct RouterSnapshot {
  std::uint64_t routed = 0, affinity = 0, spilled = 0, unmatched = 0;
  std::uint64_t tracked_blocks = 0, evicted_blocks = 0;
  std::vector<std::uint64_t> routed_per_replica;   // attempts, retries included
  std::vector<std::int64_t> load;                  // routed attempts in flight
  // decisions_by[outcome][reason]
  std::array<std::array<std::uint64_t, 6>, 3> decisions{};
  std::vector<AdapterStats> adapters;
  std::size_t table_memory_bytes = 0;
};

class Router {
 public:
  explicit Router(RouterOptions opts);

  // One decision over hashes h1..hn among `eligible` (bitmask of in-service, untried replicas).
  // `first_attempt` false marks a retry: outcome counters are not incremented (the caller counts
  // retries_total). On the first attempt the adapter's in-flight count is incremented.
  // With `defer_spill`, a decision that would spill for imbalance (step 6, reason `imbalance`)
  // returns `deferred` instead, having changed nothing (the caller waits for the loads to move and
  // asks again, the last time without it).
  Decision route(std::span<const Hash128> blocks, std::uint64_t eligible, bool first_attempt,
                 std::string_view adapter, bool defer_spill = false);
  // Whether `replica` is within the imbalance bound of the least loaded of `eligible` now (the
  // affinity condition of step 5; lock-free, for a deferred decision's wait).
  bool within_imbalance(int replica, std::uint64_t eligible) const;
  // The attempt on `replica` ended.
  void release(int replica);
  // The request (all its attempts) ended; cached_tokens as read from the reply, if any.
  // Returns the adapter's routed requests still in flight after this one.
  std::int64_t finish_request(std::string_view adapter, std::optional<std::uint64_t> cached_tokens);

  // Clears `replica`'s ownership bits (ejection, syncing, reset_prefix_cache).
  std::size_t purge_replica(int replica);
  // Names whose registry state matters for the 64-name bound (never dropped while registered).
  void set_registered(std::vector<std::string> names);

  std::int64_t load(int replica) const { return load_[replica].load(std::memory_order_relaxed); }
  std::int64_t adapter_inflight(std::string_view adapter) const;
  RouterSnapshot snapshot() const;
  const RouterOptions& options() const { return opts_; }

 private:
  // The least load over `eligible` (masked to the configured replicas; not empty).
  std::int64_t least_load(std::uint64_t eligible) const;
  AdapterStats& adapter_locked(std::string_view name);
  AdapterStats* find_adapter_locked(std::string_view name);
  const AdapterStats* find_adapter_locked(std::string_view name) const;

  RouterOptions opts_;
  std::uint64_t all_mask_;
  mutable std::mutex mu_;
  BlockTable table_;
  int cursor_ = 0;
  std::uint64_t routed_ = 0, evicted_ = 0;
  std::array<std::uint64_t, 3> outcomes_{};
  std::array<std::array<std::uint64_t, 6>, 3> decisions_{};
  std::vector<std::uint64_t> routed_per_replica_;
  std::array<std::atomic<std::int64_t>, kMaxReplicas> load_{};
  std::vector<AdapterStats> adapters_;
  std::vector<std::string> registered_;
  std::uint64_t use_clock_ = 0;
  std::vector<std::uint32_t> matched_scratch_;
};

}  // namespace lorasync::proxy
