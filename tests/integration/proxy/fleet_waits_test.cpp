// The fleet's waits without polling (docs/proxy.md): an unload's drain, a would-be spill's wait, a
// replica's health loop while it syncs and after an ejection. The proxy in process, in front of
// stub replicas.
// No assertion on elapsed time: the stubs hold a request or a load until the test lets it go
// (StubReplica::hang, hold_loads), the order of events at a replica says what waited for what
// (StubCall::completions_answered), and a path that must not be taken (a drain timeout, a probe
// interval) is set far beyond the guard that turns a hang into a failure.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <string>
#include <vector>

#include "fleet_fixture.h"
#include "util/loopback.h"

namespace lorasync::proxy {
namespace {

using namespace fixture;

// How long a test waits for an event before it gives up: a guard against a hang, not a measure.
constexpr double kGuardS = 30;
// A timeout or interval that must not be reached in a test: far beyond kGuardS.
constexpr double kNeverS = 3600;

// Routing decisions taken so far, deferred ones included (the proxy's route_decision_seconds
// histogram counts one per decision): a request in its spill wait has taken one.
int decisions(const Fleet& f) {
  const std::string m = call(f.port(), "GET", "/metrics").body;
  const std::string key = "route_decision_seconds_count ";
  const std::size_t at = m.find(key);
  return at == std::string::npos ? -1 : std::stoi(m.substr(at + key.size()));
}

// A POST of `body` to `target` on a raw connection, left open (the caller closes it to leave).
int post_raw(std::uint16_t port, const std::string& target, const std::string& body) {
  const int fd = testing::connect_loopback(port);
  EXPECT_GE(fd, 0) << "connection to port " << port << " refused";
  const std::string req = "POST " + target + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  EXPECT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  return fd;
}

// The calls of `stub` to `target`, in their order of arrival.
std::vector<bench::StubCall> calls_to(const bench::StubReplica& stub, const std::string& target) {
  std::vector<bench::StubCall> out;
  for (auto& c : stub.calls())
    if (c.target == target) out.push_back(std::move(c));
  return out;
}

// An unload waits for the adapter's requests in flight (--unload-drain-timeout) and is woken by
// the end of the last one, not by a poll or the timeout.
TEST(ProxyConformance, UnloadDrainsTheAdaptersRequestsAndEndsWhenTheLastOneDoes) {
  Fleet f(1, [](ProxyConfig& c) { c.unload_drain_timeout = kNeverS; });
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/1"})").status, 200);
  f.stubs[0]->hang = true;  // the replica holds the request until the test lets it go
  auto gen = std::async(std::launch::async, [&] { return call(f.port(), "POST", "/v1/completions", ids_prompt({1}, "policy-v1"), {}, kGuardS); });
  ASSERT_TRUE(eventually([&] { return f.stubs[0]->open_completions() == 1; }, kGuardS));
  auto unload = std::async(std::launch::async, [&] { return call(f.port(), "POST", "/v1/unload_lora_adapter", R"({"lora_name":"policy-v1"})", {}, kGuardS); });
  // The unload has begun (it takes the adapter off the registry first, then drains).
  ASSERT_TRUE(eventually([&] { return f.proxy->stats()["fleet"]["registry"].empty(); }, kGuardS));
  f.stubs[0]->hang = false;
  const Reply g = gen.get(), r = unload.get();
  EXPECT_EQ(g.status, 200) << g.body;
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(f.stubs[0]->loaded().empty());
  // The unload reached the replica only after the request had been answered: the order of events
  // at the replica.
  const auto unloads = calls_to(*f.stubs[0], "/v1/unload_lora_adapter");
  ASSERT_EQ(unloads.size(), 1u);
  EXPECT_EQ(unloads[0].completions_answered, 1u) << "the unload did not wait for the request";
  // ...and it was woken by that end, not by the drain timeout: that is an hour away, and the
  // unload's client would have given up long before (kGuardS) instead of reading its 200.
}

// --spill-wait: a request that would spill for imbalance waits for its replica's load to come back
// within the bound, is woken by the answer that brings it back (not by the wait's end) and keeps
// its affinity; when the wait ends first, it spills as the rule says.
TEST(ProxyConformance, AWouldBeSpillWaitsForItsReplicaAndSpillsOnlyWhenTheWaitEnds) {
  for (const bool kept : {true, false}) {
    SCOPED_TRACE(kept ? "the owner answers within the wait" : "the wait ends first");
    // Kept: the longest wait allowed, twice the second request's client timeout.
    constexpr double kMaxWaitS = 10, kClientS = kMaxWaitS / 2;
    Fleet f(2, [&](ProxyConfig& c) {
      c.imbalance = 0;
      c.spill_wait = kept ? kMaxWaitS : 0.2;
    });
    // The owner (replica 0, the first pick) holds the first request until the test lets it go.
    f.stubs[0]->hang = true;
    auto first = std::async(std::launch::async, [&] { return call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2}), {}, kGuardS); });
    ASSERT_TRUE(eventually([&] { return f.stubs[0]->open_completions() == 1; }, kGuardS));
    ASSERT_EQ(decisions(f), 1);
    // The same prompt: its replica (0) has one in flight, the other none, 1 - 0 > --imbalance 0.
    auto second = std::async(std::launch::async, [&] { return call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2}), {}, kept ? kClientS : kGuardS); });
    // Its decision was deferred: it waits.
    ASSERT_TRUE(eventually([&] { return decisions(f) >= 2; }, kGuardS));
    if (kept) f.stubs[0]->hang = false;  // the owner answers the first: its load comes back
    const Reply r = second.get();
    ASSERT_EQ(r.status, 200) << r.body;
    const auto router = f.proxy->stats()["router"];
    const std::string metrics = call(f.port(), "GET", "/metrics").body;
    if (kept) {
      // Kept on its replica after the owner's answer. Woken by that answer, not by the wait's
      // end: that would have come after its client had given up (kClientS), not in time for
      // this 200.
      EXPECT_EQ(*r.headers.find("X-Proxy-Upstream"), "0");
      EXPECT_EQ(router["affinity"].get<int>(), 1);
      EXPECT_EQ(router["spilled"].get<int>(), 0);
      EXPECT_EQ(router["spill_waits_kept"].get<int>(), 1);
      EXPECT_EQ(router["spill_waits_spilled"].get<int>(), 0);
      EXPECT_NE(metrics.find("lorasync_proxy_spill_waits_total{result=\"kept\"} 1"), std::string::npos) << metrics;
    } else {
      // Spilled after a wait (spill_waits_spilled counts only a decision that waited), which only
      // its end could finish: the owner still holds the first request.
      EXPECT_EQ(*r.headers.find("X-Proxy-Upstream"), "1");
      EXPECT_EQ(router["spilled"].get<int>(), 1);
      EXPECT_EQ(router["spill_waits_kept"].get<int>(), 0);
      EXPECT_EQ(router["spill_waits_spilled"].get<int>(), 1);
      EXPECT_NE(metrics.find("lorasync_proxy_spill_waits_total{result=\"spilled\"} 1"), std::string::npos) << metrics;
      EXPECT_EQ(f.stubs[0]->open_completions(), 1) << "the owner answered during the wait";
      EXPECT_EQ(f.stubs[0]->completions(), 1u);
      f.stubs[0]->hang = false;
    }
    EXPECT_EQ(first.get().status, 200);
  }
}

// A client that leaves during its spill wait is noticed at once (not when the wait ends, nor at
// the owner's next answer): the request is dropped without reaching any replica.
TEST(ProxyConformance, AClientLeavingDuringItsSpillWaitEndsItAtOnce) {
  Fleet f(2, [&](ProxyConfig& c) {
    c.imbalance = 0;
    c.spill_wait = 10;
  });
  // The owner (replica 0) holds the first request until the end of the test: it never answers
  // during the wait.
  f.stubs[0]->hang = true;
  auto first = std::async(std::launch::async, [&] { return call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2}), {}, kGuardS); });
  ASSERT_TRUE(eventually([&] { return f.stubs[0]->open_completions() == 1; }, kGuardS));
  ASSERT_EQ(decisions(f), 1);
  // The same prompt would spill (1 - 0 > --imbalance 0): it waits; its client leaves then.
  const int fd = post_raw(f.port(), "/v1/completions", ids_prompt({1, 2}));
  ASSERT_TRUE(eventually([&] { return decisions(f) >= 2; }, kGuardS)) << "the request never waited";
  ::close(fd);
  EXPECT_TRUE(eventually([&] { return f.proxy->stats()["proxy"]["client_aborts"].get<int>() == 1; }, kGuardS));
  // Dropped in its wait, by the departure: the owner never answered, and a wait that had ended
  // (10 s) would have counted a decision (spill_waits_*) and sent it to replica 1.
  const auto router = f.proxy->stats()["router"];
  EXPECT_EQ(router["routed"].get<int>(), 1);
  EXPECT_EQ(router["spill_waits_kept"].get<int>() + router["spill_waits_spilled"].get<int>(), 0);
  EXPECT_EQ(f.count(0, "/v1/completions") + f.count(1, "/v1/completions"), 1);
  EXPECT_EQ(f.stubs[0]->open_completions(), 1) << "the owner answered during the wait";
  f.stubs[0]->hang = false;
  EXPECT_EQ(first.get().status, 200);
}

// While a replica syncs, its health loop sleeps until the re-sync ends (no probe is due, no tick):
// the process stays idle, where a loop that re-checked without waiting would burn a core.
TEST(ProxyConformance, AHealthLoopSleepsWhileItsReplicaSyncs) {
  Fleet f(2, [](ProxyConfig& c) { c.reconcile_interval = 0.1; });
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/1"})").status, 200);
  f.stubs[1]->hold_loads = true;  // the re-sync's load waits until the test lets it go
  f.stubs[1]->forget_adapters();
  auto state = [&](int r) { return f.proxy->stats()["upstreams"][r]["state"]; };
  ASSERT_TRUE(eventually([&] { return state(1) == "syncing"; }, kGuardS));
  auto wakeups = [&](int r) { return f.proxy->stats()["upstreams"][r]["health_wakeups"].get<std::uint64_t>(); };
  // Six health probes of replica 0 (--probe-interval 0.2 s) and about ten reconciliation ticks:
  // a stretch counted in the proxy's own events. Replica 1's health loop passes not once over it
  // (a loop that re-checked without waiting would count thousands of passes); a slower machine
  // only makes the stretch longer.
  const int probes0 = f.count(0, "/health");
  const std::uint64_t w0 = wakeups(0), w1 = wakeups(1);
  ASSERT_TRUE(eventually([&] { return f.count(0, "/health") >= probes0 + 6; }, kGuardS));
  EXPECT_EQ(state(1), "syncing");
  EXPECT_EQ(wakeups(1), w1) << "replica 1's health loop woke while its replica synced";
  EXPECT_GE(wakeups(0) - w0, 6u) << "the counter counts the other loop's passes (a probe each)";
  f.stubs[1]->hold_loads = false;
  EXPECT_TRUE(eventually([&] { return state(1) == "in_service"; }, kGuardS)) << "woken by the end of the re-sync";
}

// A replica ejected by its own failed probe is probed again when its cooldown ends, not at the
// next probe interval (an hour here): cooldowns of 0.2, 0.4 and 0.8 s give three more probes.
TEST(ProxyConformance, AnEjectedReplicaIsProbedAgainWhenItsCooldownEnds) {
  Fleet f(2, [](ProxyConfig& c) {
    c.probe_interval = kNeverS;
    c.eject_after = 1;
  });
  f.stubs[1]->health_status.store(503);
  // A new proxy, whose first probe (at its start) finds the 503 and ejects the replica; the
  // next probe interval is an hour away.
  f.restart_proxy();
  ASSERT_TRUE(eventually([&] { return f.proxy->stats()["upstreams"][1]["state"] == "ejected"; }, kGuardS));
  const int first = f.count(1, "/health");
  EXPECT_TRUE(eventually([&] { return f.count(1, "/health") >= first + 3; }, kGuardS))
      << f.count(1, "/health") - first << " probes since the ejection: " << f.proxy->stats()["upstreams"][1].dump();
  // (Ejected, or probing while a probe is on its way: never back in service.)
  EXPECT_NE(f.proxy->stats()["upstreams"][1]["state"], "in_service");
}

}  // namespace
}  // namespace lorasync::proxy
