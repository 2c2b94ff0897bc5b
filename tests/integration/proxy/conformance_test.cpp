// Proxy conformance tests (proxy.md §7): an in-process Proxy in front of in-process stub
// replicas, all on loopback port 0. Deterministic (fixed traces), bounded in time.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <unistd.h>

#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <nlohmann/json.hpp>
#include <atomic>
#include <functional>
#include <thread>

#include "bench/proxy/stub_replica.h"
#include "core/io/adapter_manifest.h"
#include "http/client.h"
#include "http/server.h"
#include "proxy/proxy.h"
#include "util/error.h"
#include "util/sha256.h"
#include <set>
#include "fleet_fixture.h"

namespace lorasync::proxy {
namespace {

using namespace fixture;


TEST(ProxyConformance, IdenticalPromptsStickAndDistinctSpread) {
  Fleet f(2);
  std::set<std::string> ups;
  for (int i = 0; i < 8; ++i) {
    auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2, 3}));
    ASSERT_EQ(r.status, 200) << r.body;
    ups.insert(*r.headers.find("X-Proxy-Upstream"));
    EXPECT_EQ(*r.headers.find("X-Proxy-Attempts"), "1");
  }
  EXPECT_EQ(ups.size(), 1u);
  for (int i = 0; i < 16; ++i) ASSERT_EQ(call(f.port(), "POST", "/v1/completions", ids_prompt({100 + i, 200 + i})).status, 200);
  auto s = f.proxy->stats();
  std::vector<std::uint64_t> tot = {s["upstreams"][0]["routed"].get<std::uint64_t>(), s["upstreams"][1]["routed"].get<std::uint64_t>()};
  std::sort(tot.begin(), tot.end());
  EXPECT_EQ(tot, (std::vector<std::uint64_t>{8, 16}));
  // One extending the first follows it.
  auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({1, 2, 3, 4}));
  EXPECT_EQ(*r.headers.find("X-Proxy-Upstream"), *ups.begin());
  s = f.proxy->stats();
  EXPECT_EQ(s["router"]["affinity"].get<int>(), 8);
  EXPECT_EQ(s["router"]["routed"].get<int>(), s["router"]["affinity"].get<int>() + s["router"]["spilled"].get<int>() +
                                                   s["router"]["unmatched"].get<int>());
}

TEST(ProxyConformance, TemplateAndVersions) {
  Fleet f(2);
  std::vector<std::string> ups;
  for (int p = 0; p < 20; ++p) {
    auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({7, 8, 300 + p}));
    ups.push_back(*r.headers.find("X-Proxy-Upstream"));
  }
  auto s = f.proxy->stats();
  EXPECT_GE(s["router"]["unmatched"].get<int>(), 18);
  EXPECT_LE(s["router"]["affinity"].get<int>(), 2);
  auto d = s["upstreams"][0]["routed"].get<int>() - s["upstreams"][1]["routed"].get<int>();
  EXPECT_LE(std::abs(d), 2);
  EXPECT_EQ(*call(f.port(), "POST", "/v1/completions", ids_prompt({7, 8, 306})).headers.find("X-Proxy-Upstream"), ups[6]);
  Fleet g(2);
  call(g.port(), "POST", "/v1/completions", ids_prompt({1, 2}, "policy-v1"));
  call(g.port(), "POST", "/v1/completions", ids_prompt({1, 2}, "policy-v2"));
  EXPECT_EQ(g.proxy->stats()["router"]["affinity"].get<int>(), 0);
}

TEST(ProxyConformance, LoadRetriesNoAdapterFoundOnLaggingReplicaOnly) {
  Fleet f(2, {}, [](bench::StubOptions& o, int i) { o.no_adapter_found_first = i == 0 ? 3 : 0; });
  auto r = call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/policy-v1"})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(f.count(0, "/v1/load_lora_adapter"), 4);
  EXPECT_EQ(f.count(1, "/v1/load_lora_adapter"), 1);
  EXPECT_EQ(r.j()["replicas"][0]["attempts"].get<int>(), 4);
  EXPECT_EQ(f.proxy->stats()["fleet"]["registry"], json::array({"policy-v1"}));
}

TEST(ProxyConformance, LoadAllOrNothingRollsBack) {
  Fleet f(2, {}, [](bench::StubOptions& o, int i) { o.load_fail_status = i == 1 ? 400 : 0; });
  auto r = call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v2","lora_path":"/b/x"})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("rolled back"), std::string::npos);
  EXPECT_EQ(f.count(0, "/v1/load_lora_adapter"), 1);
  EXPECT_EQ(f.count(0, "/v1/unload_lora_adapter"), 1);
  EXPECT_TRUE(f.stubs[0]->loaded().empty());
  EXPECT_TRUE(f.proxy->stats()["fleet"]["registry"].empty());
  EXPECT_EQ(r.j()["replicas"][0]["rollback"], "ok");
  // Lag past the deadline: 504.
  Fleet g(2, [](ProxyConfig& c) { c.adapter_load_deadline = 0.3; }, [](bench::StubOptions& o, int i) { o.no_adapter_found_first = i == 1 ? 1000 : 0; });
  auto r2 = call(g.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v3","lora_path":"/b/y"})");
  EXPECT_EQ(r2.status, 504) << r2.body;
  EXPECT_TRUE(g.stubs[0]->loaded().empty());
  // Malformed load bodies are 400 with no upstream call.
  EXPECT_EQ(call(g.port(), "POST", "/v1/load_lora_adapter", R"({"lora_path":"/b/y"})").status, 400);
}

// Issue 16: a rollback never unloads an adapter that a replica held before the load (it answered
// "created": false): the fleet's working adapter survives a failed re-send of the same load.
TEST(ProxyConformance, RollbackKeepsAnAdapterAReplicaAlreadyHad) {
  Fleet f(2, {}, [](bench::StubOptions& o, int i) { o.load_fail_status = i == 1 ? 400 : 0; });
  auto pre = call(f.stubs[0]->port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/v1"})");
  ASSERT_EQ(pre.status, 200) << pre.body;
  auto r = call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/v1"})");
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_EQ(f.count(0, "/v1/unload_lora_adapter"), 0);
  ASSERT_EQ(f.stubs[0]->loaded().size(), 1u);
  EXPECT_EQ(f.stubs[0]->loaded()[0], "policy-v1");
  EXPECT_EQ(r.j()["replicas"][0]["rollback"], "kept");
  // A name the replica did not have is still rolled back.
  auto r2 = call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v2","lora_path":"/b/v2"})");
  EXPECT_EQ(r2.status, 400);
  EXPECT_EQ(f.count(0, "/v1/unload_lora_adapter"), 1);
  EXPECT_EQ(r2.j()["replicas"][0]["rollback"], "ok");
}

TEST(ProxyConformance, BroadcastsFanInAndPrimary) {
  Fleet f(2);
  auto p = call(f.port(), "POST", "/pause?mode=keep");
  EXPECT_EQ(p.status, 200) << p.body;
  EXPECT_EQ(f.count(0, "/pause?mode=keep"), 1);
  EXPECT_EQ(f.count(1, "/pause?mode=keep"), 1);
  EXPECT_EQ(f.proxy->stats()["fleet"]["pause_path"], "/pause?mode=keep");
  EXPECT_EQ(call(f.port(), "POST", "/v1/unload_lora_adapter", R"({"lora_name":"never-loaded"})").status, 200);
  EXPECT_EQ(call(f.port(), "GET", "/health").status, 200);
  f.stubs[1]->health_status.store(503);
  auto h = call(f.port(), "GET", "/health");
  EXPECT_EQ(h.status, 503);
  EXPECT_NE(h.body.find("1/2 servers unhealthy"), std::string::npos) << h.body;
  f.stubs[1]->health_status.store(200);
  auto si = call(f.port(), "GET", "/server_info");
  EXPECT_EQ(si.status, 200);
  EXPECT_EQ(si.j()["stub"], 0);
  // Hop-by-hop and Connection-listed headers do not cross; repeated Set-Cookie survive.
  EXPECT_EQ(si.headers.find("Proxy-Authenticate"), nullptr);
  EXPECT_EQ(si.headers.find("Trailer"), nullptr);
  http::Headers in;
  in.add("Connection", "keep-alive, X-Secret-Hop");
  in.add("X-Secret-Hop", "1");
  in.add("TE", "trailers");
  in.add("X-Kept", "2");
  auto out = http::strip_hop_by_hop(in);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out.items()[0].name, "X-Kept");
  // The reusing form replaces what its output held (longer or shorter lists alike).
  http::Headers reused;
  for (int i = 0; i < 4; ++i) reused.add("X-Old-" + std::to_string(i), std::string(40, 'v'));
  http::strip_hop_by_hop(in, reused);
  ASSERT_EQ(reused.size(), 1u);
  EXPECT_EQ(reused.items()[0].name, "X-Kept");
  EXPECT_EQ(reused.items()[0].value, "2");
  http::Headers more;
  more.add("A", "1");
  more.add("Keep-Alive", "timeout=5");
  more.add("B-Long-Header-Name-Here", std::string(64, 'b'));
  http::strip_hop_by_hop(more, reused);
  ASSERT_EQ(reused.size(), 2u);
  EXPECT_EQ(reused.items()[0].name, "A");
  EXPECT_EQ(reused.items()[1].value, std::string(64, 'b'));
  // Names to leave out (any case) and fields to append, in the same reused strings: what the relay
  // sends its client (the upstream's own X-Request-Id and Content-Length never cross).
  http::Headers up;
  up.add("Content-Length", "12");
  up.add("x-REQUEST-id", "upstream-id");
  up.add("Content-Type", "application/json");
  up.add("Connection", "close");
  static constexpr std::string_view kDrop[] = {"content-length", "x-request-id"};
  const std::pair<std::string_view, std::string_view> mine[] = {{"X-Request-Id", "r1"}, {"X-Proxy-Upstream", "0"}};
  http::strip_hop_by_hop(up, reused, kDrop, mine);
  ASSERT_EQ(reused.size(), 3u);
  EXPECT_EQ(reused.items()[0].name, "Content-Type");
  EXPECT_EQ(reused.items()[1].name, "X-Request-Id");
  EXPECT_EQ(reused.items()[1].value, "r1");
  EXPECT_EQ(reused.items()[2].name, "X-Proxy-Upstream");
  EXPECT_EQ(reused.items()[2].value, "0");
  int cookies = 0;
  for (const auto& x : si.headers) cookies += http::iequals(x.name, "set-cookie");
  EXPECT_EQ(cookies, 2);
  EXPECT_EQ(call(f.port(), "POST", "/proxy/stats").status, 405);
  auto m = call(f.port(), "GET", "/metrics");
  EXPECT_NE(m.body.find("lorasync_proxy_routed_total"), std::string::npos);
  EXPECT_NE(m.body.find("lorasync_proxy_tracked_blocks"), std::string::npos);
}

TEST(ProxyConformance, ClosedPortGives502ThenEjection) {
  // Replica 1 is a port with nothing listening.
  Fleet f(1, [](ProxyConfig& c) { c.upstreams.push_back("http://127.0.0.1:1"); c.eject_after = 3; });
  auto h = call(f.port(), "GET", "/health");
  EXPECT_EQ(h.status, 502);
  // Answered at the refusal, not at a timeout: the dead replica's outcome is the transport error
  // (a connect or probe timeout would say "timeout").
  EXPECT_EQ(h.j()["replicas"][1]["outcome"], "transport_error") << h.body;
  EXPECT_EQ(h.j()["replicas"][0]["outcome"], "ok") << h.body;
  // Routed requests all succeed on the live replica (retried when they hit the dead one).
  for (int i = 0; i < 6; ++i) {
    auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({50 + i}));
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(*r.headers.find("X-Proxy-Upstream"), "0");
  }
  auto s = f.proxy->stats();
  EXPECT_NE(s["upstreams"][1]["state"], "in_service");
}

TEST(ProxyConformance, AllDeadGives502Then503) {
  Fleet f(0, [](ProxyConfig& c) { c.upstreams = {"http://127.0.0.1:1"}; c.eject_after = 2; c.eject_cooldown = 60; });
  // 502 (transport error, nothing left to retry) until the replica is ejected, then 503 at once.
  int n502 = 0;
  Reply r;
  for (int i = 0; i < 4; ++i) {
    r = call(f.port(), "POST", "/v1/completions", ids_prompt({1}));
    if (r.status != 502) break;
    ++n502;
    EXPECT_EQ(r.j()["error"]["type"], "proxy_error");
    EXPECT_EQ(r.j()["error"]["message"].get<std::string>().rfind("proxy: ", 0), 0u);
  }
  EXPECT_LE(n502, 2);
  EXPECT_EQ(r.status, 503) << r.body;
}

TEST(ProxyConformance, HungReplicaTimesOutWith504AndClientLeavingCancels) {
  Fleet f(1, [](ProxyConfig& c) { c.first_byte_timeout = 0.5; });
  f.stubs[0]->hang.store(true);
  auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({1}));
  // A 504 (not the client's own timeout, 10 s), and the proxy counted a first-byte timeout: it
  // gave up at --first-byte-timeout.
  EXPECT_EQ(r.status, 504) << r.body;
  const std::string m = call(f.port(), "GET", "/metrics").body;
  EXPECT_NE(m.find("upstream_failures_total{replica=\"0\",kind=\"first_byte_timeout\"} 1"), std::string::npos) << m;
  // Client leaving: a 0.5 s client timeout on a hung generation; the stub sees the close.
  Fleet g(1);
  g.stubs[0]->hang.store(true);
  auto r2 = call(g.port(), "POST", "/v1/completions", ids_prompt({2}), {}, 0.5);
  EXPECT_NE(r2.error, http::CallError::kNone);
  EXPECT_TRUE(eventually([&] { return g.stubs[0]->client_gone_seen() != 0; }));
  EXPECT_EQ(g.stubs[0]->client_gone_seen(), 1u);
  EXPECT_TRUE(eventually([&] { return g.proxy->stats()["upstreams"][0]["inflight"].get<int>() == 0; }));
  EXPECT_EQ(g.proxy->stats()["proxy"]["client_aborts"].get<int>(), 1);
}

TEST(ProxyConformance, StreamingRelayAndRestartedReplicaResync) {
  Fleet f(2, [](ProxyConfig& c) { c.reconcile_interval = 0.2; });
  auto s = call(f.port(), "POST", "/v1/completions", R"({"model":"m","prompt":[1,2],"stream":true})");
  EXPECT_EQ(s.status, 200);
  EXPECT_NE(s.body.find("data: [DONE]"), std::string::npos);
  // The first-byte histogram is labelled by the request's top-level `stream`: a `true` elsewhere in
  // the body does not make a stream.
  EXPECT_EQ(call(f.port(), "POST", "/v1/completions", R"({"model":"m","prompt":[3],"stream":false,"echo":true})").status, 200);
  const std::string m = call(f.port(), "GET", "/metrics").body;
  for (const char* label : {"stream=\"true\"} 1\n", "stream=\"false\"} 1\n"})
    EXPECT_NE(m.find(std::string("time_to_first_byte_seconds_count{route=\"completions\",") + label), std::string::npos)
        << label << "\n" << m;
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v5","lora_path":"/b/5"})").status, 200);
  ASSERT_EQ(call(f.port(), "POST", "/pause").status, 200);
  f.stubs[1]->forget_adapters();  // a restart without state
  EXPECT_TRUE(eventually([&] { return !f.stubs[1]->loaded().empty(); }));
  EXPECT_EQ(f.stubs[1]->loaded(), std::vector<std::string>{"policy-v5"});
  // The pause intent was replayed after the load: in the replica's order of arrival.
  int last_load = -1, last_pause = -1;
  auto replayed = [&] {
    const auto calls = f.stubs[1]->calls();
    for (int i = 0; i < static_cast<int>(calls.size()); ++i) {
      if (calls[static_cast<std::size_t>(i)].target == "/v1/load_lora_adapter") last_load = i;
      if (calls[static_cast<std::size_t>(i)].target == "/pause") last_pause = i;
    }
    return last_pause > last_load;
  };
  EXPECT_TRUE(eventually(replayed)) << "last /pause at " << last_pause << ", last load at " << last_load;
}


// Adapter push (docs/http-api.md), two-phase across the fleet.
std::string push_body(const std::string& name) {
  const std::string cfg = "{}", weights(1000, 'w');
  json m = {{"files", {{"adapter_config.json", {{"bytes", cfg.size()}, {"sha256", sha256_hex(cfg)}}},
                       {"adapter_model.safetensors", {{"bytes", weights.size()}, {"sha256", sha256_hex(weights)}}}}}};
  return io::make_adapter_bundle(name, "", m.dump(), {{"adapter_config.json", cfg}, {"adapter_model.safetensors", weights}});
}

TEST(ProxyConformance, PushCommitsOnlyWhenEveryReplicaPreparedElseAbortsEverywhere) {
  Fleet f(2, {}, [](bench::StubOptions&, int) {});
  http::Headers oct;
  oct.add("Content-Type", "application/octet-stream");
  auto r = call(f.port(), "POST", "/v1/lorasync/adapters/push", push_body("policy-v1"), oct);
  ASSERT_EQ(r.status, 200) << r.body;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(f.stubs[static_cast<std::size_t>(i)]->loaded(), std::vector<std::string>{"policy-v1"});
    EXPECT_EQ(f.count(i, "/v1/lorasync/adapters/prepare"), 1);
    EXPECT_EQ(f.count(i, "/v1/lorasync/adapters/commit"), 1);
  }
  EXPECT_EQ(f.proxy->stats()["fleet"]["registry"], json::array({"policy-v1"}));
  // One replica refuses: the other's prepared copy is aborted, nothing is visible, not registered.
  f.stubs[1]->prepare_fail_status = 409;
  r = call(f.port(), "POST", "/v1/lorasync/adapters/push", push_body("policy-v2"), oct);
  EXPECT_EQ(r.status, 409) << r.body;
  EXPECT_NE(r.j()["error"]["message"].get<std::string>().find("stub refuses the push of policy-v2"), std::string::npos) << r.body;
  EXPECT_EQ(f.count(0, "/v1/lorasync/adapters/abort"), 1);
  EXPECT_EQ(f.count(0, "/v1/lorasync/adapters/commit"), 1);  // only policy-v1's
  EXPECT_TRUE(f.stubs[0]->prepared().empty());
  EXPECT_EQ(f.stubs[0]->loaded(), std::vector<std::string>{"policy-v1"});
  EXPECT_EQ(f.proxy->stats()["fleet"]["registry"], json::array({"policy-v1"}));
  // A body that is not a bundle never reaches a replica; the phases are not open to clients.
  EXPECT_EQ(call(f.port(), "POST", "/v1/lorasync/adapters/push", "junk", oct).status, 400);
  EXPECT_EQ(call(f.port(), "POST", "/v1/lorasync/adapters/commit", R"({"lora_name":"policy-v1"})").status, 404);
  EXPECT_EQ(f.count(0, "/v1/lorasync/adapters/prepare"), 2);
}

TEST(ProxyConformance, AReplicaLostBetweenPrepareAndCommitIsEjectedAndResyncedFromTheProxysCopy) {
  Fleet f(2, [](ProxyConfig& c) { c.eject_cooldown = 0.2; });
  http::Headers oct;
  oct.add("Content-Type", "application/octet-stream");
  f.stubs[1]->commit_fault = 1;  // dies after preparing: its commit never answers
  const std::string body = push_body("policy-v1");
  auto r = call(f.port(), "POST", "/v1/lorasync/adapters/push", body, oct);
  ASSERT_EQ(r.status, 200) << r.body;  // the point of no return was passed: the others commit
  EXPECT_EQ(r.j()["succeeded"], 1);
  EXPECT_EQ(r.j()["replicas"][1]["outcome"], "commit_failed");
  EXPECT_EQ(f.stubs[0]->loaded(), std::vector<std::string>{"policy-v1"});
  EXPECT_NE(json::parse(call(f.port(), "GET", "/proxy/stats").body)["upstreams"][1]["state"], "in_service");
  // Back (and empty, as after a restart): re-synced with the pushed bytes before it serves.
  f.stubs[1]->commit_fault = 0;
  f.stubs[1]->forget_adapters();
  ASSERT_TRUE(eventually([&] {
    return json::parse(call(f.port(), "GET", "/proxy/stats").body)["upstreams"][1]["state"] == "in_service";
  }));
  EXPECT_EQ(f.stubs[1]->loaded(), std::vector<std::string>{"policy-v1"});
  bool replayed = false;
  for (const auto& c : f.stubs[1]->calls())
    if (c.target == "/v1/lorasync/adapters/push") replayed = c.body == body;
  EXPECT_TRUE(replayed) << "the re-sync did not replay the proxy's copy of the push";
  // A commit that answers an error is handled the same way.
  f.stubs[0]->commit_fault = 2;
  r = call(f.port(), "POST", "/v1/lorasync/adapters/push", push_body("policy-v2"), oct);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(f.stubs[1]->loaded(), (std::vector<std::string>{"policy-v1", "policy-v2"}));
  EXPECT_NE(json::parse(call(f.port(), "GET", "/proxy/stats").body)["upstreams"][0]["state"], "in_service");
}

// A replica out of service while the fleet resumes and unloads rejoins in the fleet's state:
// not paused, without the adapter it missed the unload of; an adapter loaded behind the proxy's
// back is removed by reconciliation.
TEST(ProxyConformance, RejoiningReplicaConvergesToTheFleetState) {
  Fleet f(2, [](ProxyConfig& c) { c.reconcile_interval = 0.2; });
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/1"})").status, 200);
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v2","lora_path":"/b/2"})").status, 200);
  ASSERT_EQ(call(f.port(), "POST", "/pause?mode=keep").status, 200);
  EXPECT_TRUE(f.stubs[1]->paused());
  f.stubs[1]->health_status = 503;  // out of service
  ASSERT_TRUE(eventually([&] {
    return json::parse(call(f.port(), "GET", "/proxy/stats").body)["upstreams"][1]["state"] == "ejected";
  }));
  ASSERT_EQ(call(f.port(), "POST", "/resume").status, 200);
  ASSERT_EQ(call(f.port(), "POST", "/v1/unload_lora_adapter", R"({"lora_name":"policy-v1"})").status, 200);
  EXPECT_FALSE(f.stubs[0]->paused());
  EXPECT_TRUE(f.stubs[1]->paused()) << "the ejected replica missed the resume";
  f.stubs[1]->health_status = 200;  // back
  EXPECT_TRUE(eventually([&] { return !f.stubs[1]->paused() && f.stubs[1]->loaded() == std::vector<std::string>{"policy-v2"}; }))
      << "paused " << f.stubs[1]->paused() << ", adapters " << json(f.stubs[1]->loaded()).dump();
  f.stubs[0]->add_adapter("rogue");
  EXPECT_TRUE(eventually([&] { return f.stubs[0]->loaded() == std::vector<std::string>{"policy-v2"}; }))
      << json(f.stubs[0]->loaded()).dump();
}

// A re-sync never holds the fleet: while one replica's re-sync waits on a slow load, a fleet load
// completes on the others at once (the syncing replica is skipped), and the re-sync then converges
// again to include it (the fleet's epoch moved) before the replica returns to service.
TEST(ProxyConformance, AReSyncNeverHoldsTheFleetLockAndConvergesToLaterOperations) {
  Fleet f(2, [](ProxyConfig& c) { c.reconcile_interval = 0.1; });
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v1","lora_path":"/b/1"})").status, 200);
  f.stubs[1]->hold_loads = true;  // replica 1's loads wait until the test lets them go
  f.stubs[1]->forget_adapters();  // reconciliation finds policy-v1 missing: re-sync, a held load
  auto state = [&](int r) { return json::parse(call(f.port(), "GET", "/proxy/stats").body)["upstreams"][r]["state"]; };
  ASSERT_TRUE(eventually([&] { return state(1) == "syncing"; }));
  // Answered while the re-sync's load is still held: a load that waited for the re-sync could
  // not have ended before the test lets it go, below.
  auto r = call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v2","lora_path":"/b/2"})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(state(1), "syncing");
  EXPECT_EQ(json::parse(r.body)["skipped"], 1) << r.body;
  EXPECT_EQ(f.stubs[0]->loaded(), (std::vector<std::string>{"policy-v1", "policy-v2"}));
  f.stubs[1]->hold_loads = false;
  EXPECT_TRUE(eventually([&] { return state(1) == "in_service"; }));
  EXPECT_EQ(f.stubs[1]->loaded(), (std::vector<std::string>{"policy-v1", "policy-v2"}))
      << "a replica returns to service only in the fleet's current state";
}

// A routed 404 for a registered adapter (the replica restarted and lost it) goes to another
// replica, and the one that lost it is re-synced.
TEST(ProxyConformance, RoutedNotFoundForARegisteredAdapterRetriesAndResyncs) {
  Fleet f(2, [](ProxyConfig& c) { c.reconcile_interval = 0.2; });
  for (auto& st : f.stubs) st->strict_models = true;
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v7","lora_path":"/b/7"})").status, 200);
  // Both replicas lose it; requests pinned by affinity to either still get a 404 only when no
  // replica has it, and a 200 once one is re-synced.
  f.stubs[0]->forget_adapters();
  int ok = 0, lost = 0;
  for (int i = 0; i < 8; ++i) {
    auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({i + 1}, "policy-v7"));
    if (r.status == 200) ++ok;
    if (r.status == 404) ++lost;
  }
  EXPECT_EQ(ok, 8) << "a 404 from the replica that lost the adapter is retried on the other";
  EXPECT_EQ(lost, 0);
  EXPECT_TRUE(eventually([&] { return f.stubs[0]->loaded() == std::vector<std::string>{"policy-v7"}; }));
  auto m = call(f.port(), "GET", "/metrics").body;
  EXPECT_NE(m.find("lost_adapter_404_total"), std::string::npos);
}

// Expect: 100-continue ends at the proxy (it answers 100 itself and holds the body), and an
// upstream's interim 1xx answer is skipped, never relayed as the final status.
TEST(ProxyConformance, ExpectContinueAndInterimResponses) {
  Fleet f(1);
  http::Headers h;
  h.add("Expect", "100-continue");
  auto r = call(f.port(), "POST", "/v1/completions", ids_prompt({3}), h);
  EXPECT_EQ(r.status, 200) << r.body;
  auto calls = f.stubs[0]->calls();
  ASSERT_FALSE(calls.empty());
  for (const auto& n : calls.back().header_names) EXPECT_FALSE(http::iequals(n, "expect")) << n;
  // A raw upstream that sends 103 Early Hints before its 200.
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(lfd, 1), 0);
  socklen_t len = sizeof a;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  std::thread up([lfd] {
    int c = ::accept(lfd, nullptr, nullptr);
    std::string got;
    char b[4096];
    while (got.find("\r\n\r\n") == std::string::npos) {
      ssize_t n = ::recv(c, b, sizeof b, 0);
      if (n <= 0) break;
      got.append(b, static_cast<std::size_t>(n));
    }
    const std::string out = "HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
    (void)::send(c, out.data(), out.size(), MSG_NOSIGNAL);
    ::close(c);
  });
  auto u = call(ntohs(a.sin_port), "GET", "/x");
  up.join();
  ::close(lfd);
  EXPECT_EQ(u.status, 200);
  EXPECT_EQ(u.body, "ok");
}

// A proxy restarted mid-run carries on with the fleet as it is: the adapters every replica holds
// become its registry (routed, unloadable, replayed on re-sync); one that only some replicas
// hold (a load cut short by the crash) is unloaded, so the fleet stays all-or-nothing.
TEST(ProxyConformance, ARestartedProxyRebuildsItsRegistryFromTheReplicas) {
  Fleet f(2, [](ProxyConfig& c) { c.reconcile_interval = 0.2; });
  for (auto& st : f.stubs) st->strict_models = true;
  ASSERT_EQ(call(f.port(), "POST", "/v1/load_lora_adapter", R"({"lora_name":"policy-v3","lora_path":"/b/3"})").status, 200);
  f.stubs[0]->add_adapter("policy-v4");  // half a load when the proxy died
  f.restart_proxy();
  auto stats = json::parse(call(f.port(), "GET", "/proxy/stats").body);
  EXPECT_EQ(stats["fleet"]["registry"], json::array({"policy-v3"})) << stats.dump();
  EXPECT_EQ(call(f.port(), "POST", "/v1/completions", ids_prompt({9}, "policy-v3")).status, 200);
  EXPECT_TRUE(eventually([&] { return f.stubs[0]->loaded() == std::vector<std::string>{"policy-v3"}; }))
      << json(f.stubs[0]->loaded()).dump();
  // (The re-sync returns replica 0 to service after its last pass: an unload sent before that
  // skips it and the re-sync converges it again, so wait for service to test the unload itself.)
  ASSERT_TRUE(eventually([&] {
    return json::parse(call(f.port(), "GET", "/proxy/stats").body)["upstreams"][0]["state"] == "in_service";
  }));
  ASSERT_EQ(call(f.port(), "POST", "/v1/unload_lora_adapter", R"({"lora_name":"policy-v3"})").status, 200);
  EXPECT_TRUE(eventually([&] { return f.stubs[0]->loaded().empty(); })) << json(f.stubs[0]->loaded()).dump();
  EXPECT_TRUE(f.stubs[1]->loaded().empty());
}

// A caller whose client left while it waited for a pool slot stops waiting at once (kCancelled),
// rather than holding its place until the total timeout (kPoolTimeout).
TEST(HttpPool, ACallerWaitingForASlotIsCancelledWhenItsClientLeaves) {
  bench::StubOptions so;
  bench::StubReplica stub(so);
  stub.start();
  stub.hang = true;  // the first call holds the only connection
  std::string err;
  boost::asio::io_context ioc;
  http::ClientOptions co;
  co.max_connections = 1;
  http::Pool pool(*http::Url::parse(stub.url(), err), co);
  http::CancelSignal first_gone, second_gone;
  std::atomic<http::CallError> first{http::CallError::kNone}, second{http::CallError::kNone};
  const std::string body = ids_prompt({1});
  http::Headers h;
  h.add("Content-Type", "application/json");
  auto call_with = [&](http::CancelSignal* c, std::atomic<http::CallError>* out, double total) -> http::Task<void> {
    http::CallOptions o;
    o.total_timeout_s = total;
    o.cancel = c;
    auto f = co_await pool.fetch({"POST", "/v1/completions", &h, body}, o);
    *out = f.error;
  };
  boost::asio::co_spawn(ioc, call_with(&first_gone, &first, 30), boost::asio::detached);
  boost::asio::co_spawn(ioc, call_with(&second_gone, &second, 5), boost::asio::detached);
  std::thread io([&] { ioc.run(); });
  // The first call holds the only connection (its request is at the stub); the second, started
  // with it, waits for a slot. (The signals fire on the io_context's thread, as a server's would.)
  EXPECT_TRUE(eventually([&] { return stub.open_completions() == 1; }));
  boost::asio::post(ioc, [&] { second_gone.fire(); });  // the waiting caller's client leaves
  // Its call ends while the first still holds the connection: cancelled by the departure, not by
  // its pool timeout (kPoolTimeout) nor by a freed slot.
  EXPECT_TRUE(eventually([&] { return second.load() != http::CallError::kNone; }));
  EXPECT_EQ(first.load(), http::CallError::kNone) << "the connection was freed first";
  boost::asio::post(ioc, [&] { first_gone.fire(); });  // then the one holding the connection
  io.join();
  stub.stop();
  EXPECT_EQ(second.load(), http::CallError::kCancelled) << http::call_error_name(second.load());
  EXPECT_EQ(first.load(), http::CallError::kCancelled) << http::call_error_name(first.load());
}

// In the death-test child: lowers RLIMIT_NOFILE, uses every descriptor up, then calls `url`.
// 0 when the call failed as kLocal.
int call_out_of_descriptors(const std::string& url) {
  std::string err;
  boost::asio::io_context ioc;
  http::Pool pool(*http::Url::parse(url, err), http::ClientOptions{});
  rlimit rl{64, 64};
  setrlimit(RLIMIT_NOFILE, &rl);
  while (::dup(0) >= 0) {
  }
  http::CallError e = http::CallError::kNone;
  boost::asio::co_spawn(ioc, [&]() -> http::Task<void> {
    http::CallOptions o;
    o.total_timeout_s = 5;
    auto f = co_await pool.fetch({"GET", "/health", nullptr, ""}, o);
    e = f.error;
  }, boost::asio::detached);
  ioc.run();
  return e == http::CallError::kLocal ? 0 : 10 + static_cast<int>(e);
}

// Out of file descriptors in this process: the call fails as kLocal (not the peer's fault), which
// the proxy neither counts against the replica nor retries. In a child process (death-test style),
// since it lowers RLIMIT_NOFILE.
TEST(HttpPool, RunningOutOfDescriptorsIsALocalError) {
#ifdef LORASYNC_SANITIZED
  // Under UBSan, Boost 1.74's service registry reports a vptr error when a service constructor
  // throws for want of descriptors (inside Asio, before our code sees the error).
  GTEST_SKIP() << "descriptor exhaustion is exercised in the release build";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  bench::StubOptions so;
  bench::StubReplica stub(so);
  stub.start();
  const std::string url = stub.url();
  EXPECT_EXIT(std::_Exit(call_out_of_descriptors(url)), ::testing::ExitedWithCode(0), "");
  stub.stop();
}

TEST(ProxyConformance, AuthTokenAndBadInput) {
  setenv("LORASYNC_TEST_KEY", "k3y", 1);
  setenv("LORASYNC_TEST_TOKEN", "t0ken-secret", 1);
  Fleet f(1, [](ProxyConfig& c) { c.api_key_env = "LORASYNC_TEST_KEY"; c.upstream_token_env = "LORASYNC_TEST_TOKEN"; c.max_body_bytes = 1000; });
  auto r = call(f.port(), "GET", "/health");
  EXPECT_EQ(r.status, 401);
  EXPECT_NE(r.headers.find("WWW-Authenticate"), nullptr);
  http::Headers bad;
  bad.add("Authorization", "Bearer nope");
  EXPECT_EQ(call(f.port(), "GET", "/proxy/stats", "", bad).status, 401);
  // The routed path too (it is dispatched before the others): without a key, with a wrong one.
  EXPECT_EQ(call(f.port(), "POST", "/v1/completions", ids_prompt({1})).status, 401);
  EXPECT_EQ(call(f.port(), "POST", "/v1/chat/completions", ids_prompt({1}), bad).status, 401);
  http::Headers good;
  good.add("Authorization", "Bearer k3y");
  EXPECT_EQ(call(f.port(), "POST", "/v1/completions", ids_prompt({1}), good).status, 200);
  auto calls = f.stubs[0]->calls();
  ASSERT_FALSE(calls.empty());
  for (const auto& c : calls) {
    EXPECT_EQ(c.headers_authorization, 1);
    EXPECT_EQ(c.authorization, "Bearer t0ken-secret");
  }
  std::size_t n_calls = calls.size();
  for (const char* body : {"{", "[1,2]", R"({"model":3})", R"({"prompt":true})", R"({"prompt":[1,"a"]})"}) {
    auto b = call(f.port(), "POST", "/v1/completions", body, good);
    EXPECT_EQ(b.status, 400) << body;
    EXPECT_TRUE(b.j()["error"].is_object()) << b.body;
  }
  EXPECT_EQ(call(f.port(), "POST", "/v1/completions", std::string(2000, ' '), good).status, 413);
  http::Headers gz = good;
  gz.add("Content-Encoding", "gzip");
  EXPECT_EQ(call(f.port(), "POST", "/v1/completions", "{}", gz).status, 415);
  http::Headers big = good;
  big.add("X-Big", std::string(70000, 'a'));
  EXPECT_EQ(call(f.port(), "GET", "/proxy/stats", "", big).status, 431);
  // Nothing reached the upstream; the token never shows in stats or metrics.
  size_t completions = 0;
  for (const auto& c : f.stubs[0]->calls()) completions += c.target == "/v1/completions";
  EXPECT_EQ(completions, 1u);
  (void)n_calls;
  EXPECT_EQ(call(f.port(), "GET", "/proxy/stats", "", good).body.find("t0ken-secret"), std::string::npos);
  EXPECT_EQ(call(f.port(), "GET", "/metrics", "", good).body.find("t0ken-secret"), std::string::npos);
  // Request id kept.
  http::Headers rid = good;
  rid.add("X-Request-Id", "abc-123");
  auto x = call(f.port(), "POST", "/v1/completions", ids_prompt({9}), rid);
  EXPECT_EQ(*x.headers.find("X-Request-Id"), "abc-123");
  // (The last completion call: a health probe may have arrived after it.)
  std::string forwarded_id;
  for (const auto& c : f.stubs[0]->calls())
    if (c.target == "/v1/completions") forwarded_id = c.request_id;
  EXPECT_EQ(forwarded_id, "abc-123");
}

// The HTTP server (serve and proxy) holds at most max_connections: past it a new connection gets
// a 503 with Retry-After and is closed, the open ones are untouched, and a freed slot is reused.
TEST(HttpServer, AtItsConnectionCapANewConnectionGets503AndTheOthersAreServed) {
  http::ServerOptions o;
  o.max_connections = 2;
  http::Server srv(o, [](http::Request&, http::ResponseWriter& w) -> http::Task<void> {
    co_await w.send(http::json_response(200, R"({"ok":true})"));
  });
  srv.start();
  EXPECT_EQ(srv.max_connections(), 2u);
  auto open_conn = [&] {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(srv.port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    return fd;
  };
  auto exchange = [](int fd) {
    const std::string req = "GET /x HTTP/1.1\r\nHost: a\r\n\r\n";
    EXPECT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
    std::string got;
    char buf[4096];
    while (got.find("\r\n\r\n") == std::string::npos || got.find('}') == std::string::npos) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      got.append(buf, static_cast<std::size_t>(n));
    }
    return got;
  };
  auto wait_open = [&](std::size_t n) {
    for (int i = 0; i < 500 && srv.open_connections() != n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return srv.open_connections();
  };
  const int a = open_conn(), b = open_conn();
  ASSERT_EQ(wait_open(2), 2u);
  const int c = open_conn();
  const std::string refused = exchange(c);
  EXPECT_EQ(refused.rfind("HTTP/1.1 503", 0), 0u) << refused;
  EXPECT_NE(refused.find("Retry-After: 1"), std::string::npos) << refused;
  EXPECT_NE(refused.find("connection limit"), std::string::npos) << refused;
  ::close(c);
  EXPECT_EQ(srv.refused_connections(), 1u);
  EXPECT_EQ(exchange(a).rfind("HTTP/1.1 200", 0), 0u) << "an open connection is served";
  ::close(b);
  ASSERT_EQ(wait_open(1), 1u);
  const int d = open_conn();
  EXPECT_EQ(exchange(d).rfind("HTTP/1.1 200", 0), 0u) << "a freed slot is reused";
  ::close(a);
  ::close(d);
  srv.stop(1.0);
}

TEST(ProxyConfig, Validation) {
  auto bad = [](std::function<void(ProxyConfig&)> f) {
    ProxyConfig c;
    c.upstreams = {"http://127.0.0.1:9"};
    c.upstream_token_env = "LORASYNC_TEST_TOKEN_UNSET";
    f(c);
    EXPECT_THROW(resolve_config(c), Error);
  };
  bad([](ProxyConfig& c) { c.upstreams = {}; });
  bad([](ProxyConfig& c) { c.upstreams = {"http://a:1", "http://a:1/"}; });
  bad([](ProxyConfig& c) { c.upstreams = {"ftp://a"}; });
  bad([](ProxyConfig& c) { c.upstreams = {"http://u@a:1"}; });
  bad([](ProxyConfig& c) { c.block_size = 0; });
  bad([](ProxyConfig& c) { c.spill_wait = -0.001; });
  bad([](ProxyConfig& c) { c.spill_wait = 11; });
  bad([](ProxyConfig& c) { c.listen = "nohostport"; });
  bad([](ProxyConfig& c) { c.api_key_env = "LORASYNC_TEST_KEY_UNSET"; });
  setenv("LORASYNC_TEST_TOKEN2", "x", 1);
  bad([](ProxyConfig& c) { c.upstreams = {"http://10.1.2.3:80"}; c.upstream_token_env = "LORASYNC_TEST_TOKEN2"; });
  {
    ProxyConfig off;  // 0: spill at once, as the reference
    off.upstreams = {"http://127.0.0.1:9"};
    off.upstream_token_env = "LORASYNC_TEST_TOKEN_UNSET";
    off.spill_wait = 0;
    EXPECT_NO_THROW(resolve_config(off));
    try {
      off.spill_wait = 11;
      resolve_config(off);
      ADD_FAILURE() << "a spill wait of 11 s was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--spill-wait"), std::string::npos) << e.what();
    }
  }
  ProxyConfig ok;
  ok.upstreams = {"http://10.1.2.3:80"};
  ok.upstream_token_env = "LORASYNC_TEST_TOKEN2";
  ok.allow_insecure_upstream_token = true;
  EXPECT_NO_THROW(resolve_config(ok));
}

}  // namespace
}  // namespace lorasync::proxy
