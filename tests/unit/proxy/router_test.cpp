// Router unit tests (proxy.md §7 "Unit"): the worked example and its spill variant, the
// common-prefix rule, the cursor, the LRU bound, purges, and an oracle property test against a
// naive ordered-map model written straight from §3.
#include <gtest/gtest.h>

#include <list>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "proxy/prompt_scan.h"
#include "proxy/router.h"

namespace lorasync::proxy {
namespace {

// Token-id blocks: block k of a prompt is 16 copies of id `sym`.
std::string ids_prompt(const std::vector<int>& syms, std::string_view model = "m") {
  std::string s = "{\"model\":\"" + std::string(model) + "\",\"prompt\":[";
  bool first = true;
  for (int sym : syms)
    for (int i = 0; i < 16; ++i) {
      if (!first) s += ',';
      first = false;
      s += std::to_string(sym);
    }
  return s + "]}";
}

std::vector<Hash128> blocks_of(const std::string& body) {
  PromptScan scan;
  auto err = scan_routed_request(body, 16, scan);
  EXPECT_FALSE(err) << err->message;
  return scan.blocks;
}

RouterOptions opts(int n, std::size_t bound = 500000, std::int64_t imbalance = 8) {
  RouterOptions o;
  o.n_replicas = n;
  o.max_tracked_blocks = bound;
  o.imbalance = imbalance;
  return o;
}

constexpr std::uint64_t kAll = ~std::uint64_t{0};

TEST(Router, WorkedExample) {
  Router r(opts(2));
  const int T = 1, A1 = 2, A2 = 3, B1 = 4, B2 = 5, C1 = 6, C2 = 7;
  auto d1 = r.route(blocks_of(ids_prompt({T, A1, A2})), kAll, true, "m");
  EXPECT_EQ(d1.pick, 0);
  EXPECT_EQ(d1.outcome, Outcome::kUnmatched);
  EXPECT_EQ(d1.reason, Reason::kCold);
  r.release(0);
  EXPECT_EQ(r.snapshot().tracked_blocks, 3u);
  auto d2 = r.route(blocks_of(ids_prompt({T, A1, A2})), kAll, true, "m");
  EXPECT_EQ(d2.pick, 0);
  EXPECT_EQ(d2.outcome, Outcome::kAffinity);
  EXPECT_EQ(d2.matched, 3u);
  r.release(0);
  auto d3 = r.route(blocks_of(ids_prompt({T, B1, B2})), kAll, true, "m");
  EXPECT_EQ(d3.pick, 0);
  EXPECT_EQ(d3.outcome, Outcome::kAffinity);
  r.release(0);
  EXPECT_EQ(r.snapshot().tracked_blocks, 5u);
  auto d4 = r.route(blocks_of(ids_prompt({T, C1, C2})), kAll, true, "m");
  EXPECT_EQ(d4.pick, 1);
  EXPECT_EQ(d4.outcome, Outcome::kUnmatched);
  EXPECT_EQ(d4.reason, Reason::kCommonOnly);
  r.release(1);
  auto s = r.snapshot();
  EXPECT_EQ(s.routed, 4u);
  EXPECT_EQ(s.affinity, 2u);
  EXPECT_EQ(s.spilled, 0u);
  EXPECT_EQ(s.unmatched, 2u);
  EXPECT_EQ(s.tracked_blocks, 7u);
  EXPECT_EQ(s.routed_per_replica, (std::vector<std::uint64_t>{3, 1}));
  ASSERT_EQ(s.adapters.size(), 1u);
  EXPECT_EQ(s.adapters[0].routed, 4u);
  EXPECT_EQ(s.adapters[0].blocks, 12u);
}

TEST(Router, SpillVariantAndBound) {
  // Request 2 meets loads [9, 0]: 9 - 0 > 8 spills to replica 1, which then owns the blocks too.
  Router r(opts(2));
  auto b = blocks_of(ids_prompt({1, 2, 3}));
  r.route(b, kAll, true, "m");  // pick 0, load[0] = 1
  for (int i = 0; i < 8; ++i) r.route({}, 1, true, "m");  // load[0] = 9 via replica-0-only routes
  EXPECT_EQ(r.load(0), 9);
  auto d = r.route(b, kAll, true, "m");
  EXPECT_EQ(d.outcome, Outcome::kSpilled);
  EXPECT_EQ(d.reason, Reason::kImbalance);
  EXPECT_EQ(d.pick, 1);
  // Now both own T A1 A2: block 3 is common, nothing specific -> unmatched common_only.
  auto d2 = r.route(b, kAll, true, "m");
  EXPECT_EQ(d2.outcome, Outcome::kUnmatched);
  EXPECT_EQ(d2.reason, Reason::kCommonOnly);

  // Difference exactly = imbalance -> affinity.
  Router r2(opts(2));
  r2.route(b, kAll, true, "m");
  for (int i = 0; i < 7; ++i) r2.route({}, 1, true, "m");
  EXPECT_EQ(r2.load(0), 8);
  EXPECT_EQ(r2.route(b, kAll, true, "m").outcome, Outcome::kAffinity);
}

// --spill-wait: a decision asked with defer_spill that would spill for imbalance comes back
// deferred, naming the owner, and changes nothing; within_imbalance is the affinity condition.
TEST(Router, ADeferredSpillChangesNothingAndWithinImbalanceIsTheAffinityCondition) {
  auto b = blocks_of(ids_prompt({1, 2, 3}));
  Router r(opts(2)), twin(opts(2));
  for (Router* x : {&r, &twin}) {
    x->route(b, kAll, true, "m");                            // pick 0, load[0] = 1
    for (int i = 0; i < 8; ++i) x->route({}, 1, true, "m");  // load[0] = 9
  }
  EXPECT_FALSE(r.within_imbalance(0, kAll));
  EXPECT_TRUE(r.within_imbalance(1, kAll));
  auto d = r.route(b, kAll, true, "m", true);
  EXPECT_TRUE(d.deferred);
  EXPECT_EQ(d.pick, 0);  // the owner, whose load the caller waits for
  EXPECT_EQ(d.outcome, Outcome::kSpilled);
  EXPECT_EQ(d.reason, Reason::kImbalance);
  EXPECT_EQ(d.matched, 3u);
  auto s = r.snapshot(), t = twin.snapshot();
  EXPECT_EQ(s.routed, t.routed);
  EXPECT_EQ(s.spilled, 0u);
  EXPECT_EQ(s.load, t.load);
  EXPECT_EQ(s.tracked_blocks, t.tracked_blocks);
  EXPECT_EQ(s.routed_per_replica, t.routed_per_replica);
  EXPECT_EQ(s.adapters[0].routed, t.adapters[0].routed);
  EXPECT_EQ(s.adapters[0].inflight, t.adapters[0].inflight);
  // The cursor did not move either: the twins' next unmatched decision picks alike.
  auto cold = blocks_of(ids_prompt({9}));
  EXPECT_EQ(r.route(cold, kAll, true, "m").pick, twin.route(cold, kAll, true, "m").pick);
  // Not deferred without defer_spill, nor once the owner is back within the bound.
  auto unavailable = r.route(b, 2, true, "m", true);  // the owner not eligible: owner_unavailable
  EXPECT_FALSE(unavailable.deferred);
  EXPECT_EQ(unavailable.reason, Reason::kOwnerUnavailable);
  r.release(1);
  Router u(opts(2));
  u.route(b, kAll, true, "m");
  for (int i = 0; i < 8; ++i) u.route({}, 1, true, "m");
  EXPECT_TRUE(u.route(b, kAll, true, "m", true).deferred);
  u.release(0);  // load[0] = 8: within the bound
  EXPECT_TRUE(u.within_imbalance(0, kAll));
  EXPECT_FALSE(u.within_imbalance(0, 2));  // not eligible
  auto kept = u.route(b, kAll, true, "m", true);
  EXPECT_FALSE(kept.deferred);
  EXPECT_EQ(kept.outcome, Outcome::kAffinity);
  EXPECT_EQ(kept.pick, 0);
}

TEST(Router, TemplateBecomesCommonFromThirdPrompt) {
  Router r(opts(2));
  std::vector<Outcome> outs;
  for (int p = 0; p < 20; ++p) {
    auto d = r.route(blocks_of(ids_prompt({1, 2, 100 + p, 200 + p})), kAll, true, "m");
    r.release(d.pick);
    outs.push_back(d.outcome);
  }
  EXPECT_EQ(outs[0], Outcome::kUnmatched);
  EXPECT_EQ(outs[1], Outcome::kAffinity);  // the known artefact kept for parity
  for (int p = 2; p < 20; ++p) EXPECT_EQ(outs[p], Outcome::kUnmatched) << p;
}

TEST(Router, SameSuccessorTwiceDoesNotBranch) {
  Router r(opts(2));
  auto b = blocks_of(ids_prompt({1, 2}));
  r.release(r.route(b, kAll, true, "m").pick);
  r.release(r.route(b, kAll, true, "m").pick);
  auto d = r.route(blocks_of(ids_prompt({1})), kAll, true, "m");
  EXPECT_EQ(d.outcome, Outcome::kAffinity);  // T is not branched, owned by 0 only
}

TEST(Router, BlockOwnedByAllIsCommon) {
  Router r(opts(2));
  auto b = blocks_of(ids_prompt({1}));
  r.route(b, 1, true, "m");  // owner 0
  r.route(b, 2, true, "m");  // only replica 1 eligible: spilled owner_unavailable; now owned by both
  r.release(0);
  r.release(1);
  auto d = r.route(b, kAll, true, "m");
  EXPECT_EQ(d.outcome, Outcome::kUnmatched);
  EXPECT_EQ(d.reason, Reason::kCommonOnly);
}

TEST(Router, CursorAndOwnerUnavailable) {
  Router r(opts(3));
  // No blocks, all eligible, all loads 0: 0, 1, 2, 0 (cursor rotation).
  std::vector<int> picks;
  for (int i = 0; i < 4; ++i) {
    auto d = r.route({}, kAll, true, "m");
    EXPECT_EQ(d.reason, Reason::kNoBlocks);
    picks.push_back(d.pick);
    r.release(d.pick);
  }
  EXPECT_EQ(picks, (std::vector<int>{0, 1, 2, 0}));
  // Cursor is 1; only replicas 0 and 2 eligible -> first index >= 1 among them is 2.
  auto d = r.route({}, 0b101, true, "m");
  EXPECT_EQ(d.pick, 2);
  r.release(2);
  // Cursor wrapped to 0: next among {0, 2} is 0.
  EXPECT_EQ(r.route({}, 0b101, true, "m").pick, 0);
  r.release(0);
  // Least-loaded set: load[0] = 1 -> C = {1, 2}; cursor 1 -> 1.
  r.route({}, 0b001, true, "m");
  EXPECT_EQ(r.route({}, kAll, true, "m").pick, 1);

  Router r2(opts(2));
  auto b = blocks_of(ids_prompt({5, 6}));
  r2.release(r2.route(b, kAll, true, "m").pick);  // owner 0
  auto d2 = r2.route(b, 0b10, true, "m");
  EXPECT_EQ(d2.outcome, Outcome::kSpilled);
  EXPECT_EQ(d2.reason, Reason::kOwnerUnavailable);
  EXPECT_EQ(d2.pick, 1);
}

TEST(Router, LruBoundEvictsHeadsFirstAndCounts) {
  Router r(opts(2, 5));
  r.route(blocks_of(ids_prompt({1, 2, 3})), kAll, true, "m");  // 3 entries
  r.route(blocks_of(ids_prompt({7, 8, 9, 10})), kAll, true, "m");  // +4 = 7 -> evict 2
  auto s = r.snapshot();
  EXPECT_EQ(s.tracked_blocks, 5u);
  EXPECT_EQ(s.evicted_blocks, 2u);
  // The first prompt's head blocks went first: its 3rd block is still there, but matched
  // needs h1, which is gone -> a repeat of the first prompt is cold.
  auto d = r.route(blocks_of(ids_prompt({1, 2, 3})), kAll, true, "m");
  EXPECT_EQ(d.reason, Reason::kCold);
  EXPECT_LE(r.snapshot().tracked_blocks, 5u);
  // a1, a2 recreated, a3 touched: 7 entries again -> b1, b2 evicted.
  EXPECT_EQ(r.snapshot().evicted_blocks, 4u);
}

TEST(Router, PurgeRemovesBitsAndOwnerless) {
  Router r(opts(2));
  auto a = blocks_of(ids_prompt({1, 2}));
  auto b = blocks_of(ids_prompt({3, 4}));
  r.route(a, 1, true, "m");
  r.route(b, 2, true, "m");
  r.route(a, 2, true, "m");  // a owned by both
  EXPECT_EQ(r.snapshot().tracked_blocks, 4u);
  EXPECT_EQ(r.purge_replica(1), 2u);  // b's 2 entries become ownerless
  EXPECT_EQ(r.snapshot().tracked_blocks, 2u);
  r.release(0);
  r.release(1);
  r.release(1);
  auto d = r.route(a, kAll, true, "m");
  EXPECT_EQ(d.outcome, Outcome::kAffinity);
  EXPECT_EQ(d.pick, 0);
}

TEST(Router, AdapterSeedsNeverMatchAcrossVersions) {
  Router r(opts(2));
  r.release(r.route(blocks_of(ids_prompt({1, 2, 3}, "policy-v1")), kAll, true, "policy-v1").pick);
  auto d = r.route(blocks_of(ids_prompt({1, 2, 3}, "policy-v2")), kAll, true, "policy-v2");
  EXPECT_EQ(d.outcome, Outcome::kUnmatched);
  EXPECT_EQ(d.reason, Reason::kCold);
  EXPECT_EQ(r.snapshot().affinity, 0u);
}

// ---- Oracle: a naive model of §3 on ordered maps -------------------------------------------

struct Naive {
  struct Node {
    std::uint64_t owners = 0;
    std::set<std::uint64_t> succ;  // at most 2 kept
    std::uint64_t tick = 0;
  };
  int n;
  std::size_t bound;
  std::int64_t imbalance;
  std::map<std::pair<std::uint64_t, std::uint64_t>, Node> table;
  std::uint64_t clock = 0;
  int cursor = 0;
  std::vector<std::int64_t> load;
  std::uint64_t routed = 0, aff = 0, sp = 0, un = 0, evicted = 0;

  Naive(int n_, std::size_t b, std::int64_t imb) : n(n_), bound(b), imbalance(imb), load(n_, 0) {}
  static std::pair<std::uint64_t, std::uint64_t> k(const Hash128& h) { return {h.lo, h.hi}; }

  Decision route(const std::vector<Hash128>& bl, std::uint64_t elig, bool first) {
    std::vector<std::uint32_t> matched(n, 0);
    std::uint32_t common = 0;
    std::uint64_t all = (n == 64) ? ~0ull : ((1ull << n) - 1);
    for (int r = 0; r < n; ++r) {
      std::uint32_t m = 0;
      for (std::size_t i = 0; i < bl.size(); ++i) {
        auto it = table.find(k(bl[i]));
        if (it == table.end() || !(it->second.owners >> r & 1)) break;
        m = static_cast<std::uint32_t>(i + 1);
      }
      matched[r] = m;
    }
    for (std::size_t i = 0; i < bl.size(); ++i) {
      auto it = table.find(k(bl[i]));
      if (it == table.end()) break;
      if (it->second.owners == all || it->second.succ.size() >= 2) common = static_cast<std::uint32_t>(i + 1);
    }
    auto spec = [&](int r) { return matched[r] > common ? matched[r] - common : 0u; };
    std::int64_t least = INT64_MAX;
    for (int r = 0; r < n; ++r)
      if (elig >> r & 1) least = std::min(least, load[r]);
    int best = -1;
    for (int r = 0; r < n; ++r) {
      if (!(elig >> r & 1)) continue;
      if (best < 0 || spec(r) > spec(best) || (spec(r) == spec(best) && load[r] < load[best])) best = r;
    }
    Decision d;
    if (spec(best) > 0 && load[best] - least <= imbalance) {
      d.pick = best;
      d.outcome = Outcome::kAffinity;
    } else {
      bool outside = false;
      for (int r = 0; r < n; ++r)
        if (!(elig >> r & 1) && spec(r) > 0) outside = true;
      bool any = false;
      for (int r = 0; r < n; ++r) any |= matched[r] > 0;
      d.outcome = (spec(best) > 0 || outside) ? Outcome::kSpilled : Outcome::kUnmatched;
      d.reason = spec(best) > 0 ? Reason::kImbalance
                 : outside      ? Reason::kOwnerUnavailable
                 : bl.empty()   ? Reason::kNoBlocks
                 : !any         ? Reason::kCold
                                : Reason::kCommonOnly;
      for (int j = 0; j < n; ++j) {
        int r = (cursor + j) % n;
        if ((elig >> r & 1) && load[r] == least) {
          d.pick = r;
          break;
        }
      }
      cursor = (d.pick + 1) % n;
    }
    d.matched = matched[d.pick];
    for (std::size_t i = 0; i < bl.size(); ++i) {
      Node& nd = table[k(bl[i])];
      nd.owners |= 1ull << d.pick;
      if (i + 1 < bl.size() && nd.succ.size() < 2) nd.succ.insert(bl[i + 1].fingerprint());
      nd.tick = ++clock;
    }
    while (table.size() > bound) {
      auto victim = table.begin();
      for (auto it = table.begin(); it != table.end(); ++it)
        if (it->second.tick < victim->second.tick) victim = it;
      table.erase(victim);
      ++evicted;
    }
    ++load[d.pick];
    if (first) {
      ++routed;
      (d.outcome == Outcome::kAffinity ? aff : d.outcome == Outcome::kSpilled ? sp : un)++;
    }
    return d;
  }
  void purge(int r) {
    for (auto it = table.begin(); it != table.end();) {
      it->second.owners &= ~(1ull << r);
      it = it->second.owners == 0 ? table.erase(it) : std::next(it);
    }
  }
};

TEST(Router, OracleProperty) {
  std::mt19937_64 rng(12345);
  const int kRuns = 40, kReqs = 2500;  // 100k requests in all
  for (int run = 0; run < kRuns; ++run) {
    int n = 2 + static_cast<int>(rng() % 4);
    std::size_t bound = 8 + rng() % 200;
    std::int64_t imb = static_cast<std::int64_t>(rng() % 4);
    Router router(opts(n, bound, imb));
    Naive naive(n, bound, imb);
    std::vector<int> inflight;
    for (int q = 0; q < kReqs; ++q) {
      // Prompt: model (2 namespaces) + template (3) + problem (40) + tail length.
      std::vector<Hash128> bl;
      Hash128 h = hash128(rng() % 2 ? "a" : "b");
      int tmpl = static_cast<int>(rng() % 3), prob = static_cast<int>(rng() % 40);
      int len = static_cast<int>(rng() % 9);
      for (int i = 0; i < len; ++i) {
        std::uint64_t sym = i < 2 ? 1000u + static_cast<unsigned>(tmpl) : (i < 5 ? 2000u + static_cast<unsigned>(prob) : rng() % 3);
        std::uint64_t buf[3] = {h.lo, h.hi, sym};
        h = hash128(buf, sizeof buf);
        bl.push_back(h);
      }
      std::uint64_t elig = rng() % 5 == 0 ? (rng() & ((1ull << n) - 1)) : ~0ull;
      if ((elig & ((1ull << n) - 1)) == 0) elig = 1;
      bool first = rng() % 7 != 0;
      // A deferred spill (--spill-wait) changes nothing: asked first with defer_spill, a decision
      // either comes out as it would have, or deferred, and then the same when asked without.
      if (first && rng() % 2 == 0) {
        const auto deferred = router.route(bl, elig, first, "m", true);
        if (!deferred.deferred) {
          const auto b = naive.route(bl, elig, first);
          ASSERT_EQ(deferred.pick, b.pick) << "run " << run << " req " << q;
          ASSERT_EQ(deferred.outcome, b.outcome) << "run " << run << " req " << q;
          ASSERT_EQ(deferred.reason, b.reason) << "run " << run << " req " << q;
          inflight.push_back(deferred.pick);
          continue;
        }
        ASSERT_EQ(deferred.reason, Reason::kImbalance) << "run " << run << " req " << q;
        ASSERT_FALSE(router.within_imbalance(deferred.pick, elig));
      }
      auto a = router.route(bl, elig, first, "m");
      auto b = naive.route(bl, elig, first);
      ASSERT_EQ(a.pick, b.pick) << "run " << run << " req " << q;
      ASSERT_EQ(a.outcome, b.outcome) << "run " << run << " req " << q;
      ASSERT_EQ(a.reason, b.reason) << "run " << run << " req " << q;
      ASSERT_EQ(a.matched, b.matched);
      inflight.push_back(a.pick);
      // Random completions keep loads moving.
      while (!inflight.empty() && rng() % 3 != 0) {
        std::size_t i = rng() % inflight.size();
        router.release(inflight[i]);
        --naive.load[inflight[i]];
        inflight.erase(inflight.begin() + static_cast<long>(i));
      }
      if (rng() % 500 == 0) {
        int r = static_cast<int>(rng() % static_cast<unsigned>(n));
        router.purge_replica(r);
        naive.purge(r);
      }
    }
    auto s = router.snapshot();
    EXPECT_EQ(s.routed, naive.routed);
    EXPECT_EQ(s.affinity, naive.aff);
    EXPECT_EQ(s.spilled, naive.sp);
    EXPECT_EQ(s.unmatched, naive.un);
    EXPECT_EQ(s.tracked_blocks, naive.table.size());
    EXPECT_EQ(s.evicted_blocks, naive.evicted);
    EXPECT_EQ(s.routed, s.affinity + s.spilled + s.unmatched);
  }
}

TEST(Router, ConcurrentRoutingKeepsInvariant) {
  Router r(opts(3, 1000));
  std::vector<std::thread> ts;
  for (int t = 0; t < 8; ++t)
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      for (int i = 0; i < 5000; ++i) {
        std::vector<Hash128> bl;
        Hash128 h{1, 2};
        for (int k = 0; k < static_cast<int>(rng() % 6); ++k) {
          std::uint64_t buf[3] = {h.lo, h.hi, rng() % 4};
          h = hash128(buf, sizeof buf);
          bl.push_back(h);
        }
        auto d = r.route(bl, ~0ull, true, t % 2 ? "x" : "y");
        r.release(d.pick);
        r.finish_request(t % 2 ? "x" : "y", std::nullopt);
      }
    });
  for (auto& t : ts) t.join();
  auto s = r.snapshot();
  EXPECT_EQ(s.routed, 40000u);
  EXPECT_EQ(s.routed, s.affinity + s.spilled + s.unmatched);
  for (auto l : s.load) EXPECT_EQ(l, 0);
  for (const auto& a : s.adapters) EXPECT_EQ(a.inflight, 0);
  EXPECT_LE(s.tracked_blocks, 1000u);
}

TEST(Router, MemoryPerBlockAtDefaultBound) {
  BlockTable t(500000);
  for (std::uint64_t i = 0; i < 500000; ++i) t.find_or_insert(hash128(&i, sizeof i));
  EXPECT_EQ(t.size(), 500000u);
  double per = static_cast<double>(t.memory_bytes()) / 500000.0;
  EXPECT_LE(per, 64.0) << per;
}

}  // namespace
}  // namespace lorasync::proxy
