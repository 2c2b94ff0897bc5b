// The fleet's waits without polling (docs/proxy.md): an unload's drain, a replica's health loop
// while it syncs and after an ejection. The proxy in process, in front of stub replicas.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "fleet_fixture.h"
#include "util/bench_report.h"

namespace lorasync::proxy {
namespace {

using namespace fixture;

// An unload waits for the adapter's requests in flight (--unload-drain-timeout) and is woken by
// the end of the last one, not by a poll or the timeout.
TEST(ProxyConformance, UnloadDrainsTheAdaptersRequestsAndEndsWhenTheLastOneDoes) {
  Fleet f(1, [](ProxyConfig& c) { c.unload_drain_timeout = 8; });
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/1"})").status, 200);
  f.stubs[0]->latency_s = 0.6;
  std::atomic<double> generation_ended{0};
  std::thread gen([&] {
    EXPECT_EQ(call(f.port(), "POST", "/v1/completions", ids_prompt({1}, "policy-v1")).status, 200);
    generation_ended = now_seconds();
  });
  ASSERT_TRUE(eventually([&] { return f.proxy->stats()["upstreams"][0]["inflight"].get<int>() == 1; }));
  const double t0 = now_seconds();
  auto r = call(f.port(), "POST", "/v1/unload_lora_adapter", R"({"lora_name":"policy-v1"})");
  const double unloaded = now_seconds();
  gen.join();
  EXPECT_EQ(r.status, 200) << r.body;
  // The unload reached the replica only after the request had been answered...
  ASSERT_GT(generation_ended.load(), 0);
  EXPECT_GE(unloaded + 0.25, generation_ended.load());  // (the client may read its answer late)
  EXPECT_GE(unloaded - t0, 0.3) << "the unload did not wait for the request (0.6 s at the replica)";
  EXPECT_TRUE(f.stubs[0]->loaded().empty());
  // ...and right after it: far from the 8 s timeout (the request had at most 0.6 s left).
  EXPECT_LT(unloaded - t0, 3.0);
}

// --spill-wait: a request that would spill for imbalance waits for its replica's load to come back
// within the bound, is woken by the answer that brings it back (not by the wait's end) and keeps
// its affinity; when the wait ends first, it spills as the rule says.
TEST(ProxyConformance, AWouldBeSpillWaitsForItsReplicaAndSpillsOnlyWhenTheWaitEnds) {
  for (const bool kept : {true, false}) {
    SCOPED_TRACE(kept ? "the owner answers within the wait" : "the wait ends first");
    Fleet f(2, [&](ProxyConfig& c) {
      c.imbalance = 0;
      c.spill_wait = kept ? 4.0 : 0.2;
    });
    for (auto& s : f.stubs) s->latency_s = kept ? 0.5 : 1.0;
    std::thread first([&] { EXPECT_EQ(call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2})).status, 200); });
    ASSERT_TRUE(eventually([&] { return f.proxy->stats()["router"]["routed"].get<int>() == 1; }));
    // The same prompt: its replica (0) has one in flight, the other none, 1 - 0 > --imbalance 0.
    const double t0 = now_seconds();
    auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2}));
    const double took = now_seconds() - t0;
    first.join();
    ASSERT_EQ(r.status, 200) << r.body;
    const auto router = f.proxy->stats()["router"];
    const std::string metrics = call(f.port(), "GET", "/metrics").body;
    if (kept) {
      EXPECT_EQ(*r.headers.find("X-Proxy-Upstream"), "0");
      EXPECT_EQ(router["affinity"].get<int>(), 1);
      EXPECT_EQ(router["spilled"].get<int>(), 0);
      EXPECT_EQ(router["spill_waits_kept"].get<int>(), 1);
      EXPECT_EQ(router["spill_waits_spilled"].get<int>(), 0);
      EXPECT_NE(metrics.find("lorasync_proxy_spill_waits_total{result=\"kept\"} 1"), std::string::npos) << metrics;
      // Woken by the first answer (at most 0.5 s away), then served in 0.5 s: far from the 4 s wait.
      EXPECT_LT(took, 2.5);
    } else {
      EXPECT_EQ(*r.headers.find("X-Proxy-Upstream"), "1");
      EXPECT_EQ(router["spilled"].get<int>(), 1);
      EXPECT_EQ(router["spill_waits_kept"].get<int>(), 0);
      EXPECT_EQ(router["spill_waits_spilled"].get<int>(), 1);
      EXPECT_NE(metrics.find("lorasync_proxy_spill_waits_total{result=\"spilled\"} 1"), std::string::npos) << metrics;
      EXPECT_GE(took, 1.15);  // the 0.2 s wait, then the 1 s service time on the other replica
    }
  }
}

// A client that leaves during its spill wait is noticed at once (not when the wait ends, nor at
// the owner's next answer): the request is dropped without reaching any replica.
TEST(ProxyConformance, AClientLeavingDuringItsSpillWaitEndsItAtOnce) {
  Fleet f(2, [&](ProxyConfig& c) {
    c.imbalance = 0;
    c.spill_wait = 8.0;
  });
  for (auto& s : f.stubs) s->latency_s = 4.0;
  std::thread first([&] { EXPECT_EQ(call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2})).status, 200); });
  ASSERT_TRUE(eventually([&] { return f.proxy->stats()["router"]["routed"].get<int>() == 1; }));
  // The same prompt would spill (1 - 0 > --imbalance 0): it waits; its client gives up after 0.5 s.
  const double t0 = now_seconds();
  auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2}), {}, 0.5);
  EXPECT_NE(r.error, http::CallError::kNone);
  EXPECT_TRUE(eventually([&] { return f.proxy->stats()["proxy"]["client_aborts"].get<int>() == 1; }, 1.5));
  EXPECT_LT(now_seconds() - t0, 2.5) << "noticed before the owner's answer (4 s) and the wait's end (8 s)";
  const auto router = f.proxy->stats()["router"];
  EXPECT_EQ(router["routed"].get<int>(), 1);
  EXPECT_EQ(router["spill_waits_kept"].get<int>() + router["spill_waits_spilled"].get<int>(), 0);
  EXPECT_EQ(f.count(0, "/v1/completions") + f.count(1, "/v1/completions"), 1);
  first.join();
}

// While a replica syncs, its health loop sleeps until the re-sync ends (no probe is due, no tick):
// the process stays idle, where a loop that re-checked without waiting would burn a core.
TEST(ProxyConformance, AHealthLoopSleepsWhileItsReplicaSyncs) {
  Fleet f(2, [](ProxyConfig& c) { c.reconcile_interval = 0.1; });
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/1"})").status, 200);
  f.stubs[1]->load_delay_s = 3.0;
  f.stubs[1]->forget_adapters();
  auto state = [&](int r) { return f.proxy->stats()["upstreams"][r]["state"]; };
  ASSERT_TRUE(eventually([&] { return state(1) == "syncing"; }));
  auto cpu_s = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  const double c0 = cpu_s(), t0 = now_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  const double cpu = cpu_s() - c0, wall = now_seconds() - t0;
  EXPECT_EQ(state(1), "syncing");
  EXPECT_LT(cpu, 0.4 * wall) << "the proxy (and stubs) used " << cpu << " s of CPU in " << wall << " s while idle";
  f.stubs[1]->load_delay_s = 0.0;
  EXPECT_TRUE(eventually([&] { return state(1) == "in_service"; })) << "woken by the end of the re-sync";
}

// A replica ejected by its own failed probe is probed again when its cooldown ends, not at the
// next probe interval (5 s here): cooldowns of 0.2, 0.4 and 0.8 s give three more probes in 1.4 s.
TEST(ProxyConformance, AnEjectedReplicaIsProbedAgainWhenItsCooldownEnds) {
  Fleet f(2, [](ProxyConfig& c) {
    c.probe_interval = 5;
    c.eject_after = 1;
  });
  f.stubs[1]->health_status.store(503);
  // The first probe, sent at start, may have come before the 503 did: the one after it ejects.
  ASSERT_TRUE(eventually([&] { return f.proxy->stats()["upstreams"][1]["state"] == "ejected"; }, 8.0));
  const int first = f.count(1, "/health");
  EXPECT_TRUE(eventually([&] { return f.count(1, "/health") >= first + 3; }, 4.0))
      << f.count(1, "/health") - first << " probes since the ejection: " << f.proxy->stats()["upstreams"][1].dump();
  // (Ejected, or probing while a probe is on its way: never back in service.)
  EXPECT_NE(f.proxy->stats()["upstreams"][1]["state"], "in_service");
}

}  // namespace
}  // namespace lorasync::proxy
