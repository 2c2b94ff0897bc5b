// Integration of `lorasync proxy` with two real `lorasync serve` replicas on loopback (binaries,
// port 0): equality with direct answers, fleet-wide adapter loads, a GRPO trace routed with
// unmatched near the 1/G floor, and a replica killed mid-run and brought back: no request that had
// not started is lost, traffic leaves it within a second, and it gets the current adapters back
// before it serves again.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <random>
#include <thread>

#include "util/child_process.h"
#include "util/files.h"
#include "util/http_client.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using nlohmann::json;
using testing::http_request;

std::unique_ptr<testing::ChildProcess> start_replica(const fs::path& model, const fs::path& root, std::uint16_t port,
                                                     std::uint16_t* out_port) {
  auto p = std::make_unique<testing::ChildProcess>(std::vector<std::string>{
      LORASYNC_BINARY, "serve", "--model", model.string(), "--served-model-name", "tiny", "--port",
      std::to_string(port), "--kv-cache-memory", "32MiB", "--max-model-len", "512", "--max-loras", "4",
      "--max-lora-rank", "8", "--allowed-adapter-root", root.string()});
  auto line = p->read_line(60);
  if (!line) throw std::runtime_error("replica did not start: " + p->stderr_text());
  *out_port = static_cast<std::uint16_t>(json::parse(*line)["port"].get<int>());
  return p;
}

json stats(std::uint16_t proxy) { return json::parse(http_request(proxy, "GET", "/proxy/stats").body); }

TEST(ProxyWithRealReplicas, RoutesLoadsAndSurvivesAReplicaRestart) {
  TempDir dir("lorasync-proxy-serve");
  auto model = dir.path() / "tiny";
  auto r = testing::run_lorasync("init-model --preset tiny --seed 4 --init-std 0.1 --output " +
                                 testing::shell_quote(model.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto adapters = dir.path() / "adapters";
  r = testing::run_lorasync("init-adapter --model " + testing::shell_quote(model.string()) + " --output " +
                            testing::shell_quote((adapters / "policy-v1").string()) + " --rank 4 --alpha 8 --b-std 0.2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::uint16_t p0 = 0, p1 = 0;
  auto rep0 = start_replica(model, adapters, 0, &p0);
  auto rep1 = start_replica(model, adapters, 0, &p1);
  testing::ChildProcess proxy({LORASYNC_BINARY, "proxy", "--listen", "127.0.0.1:0", "--upstream",
                               "http://127.0.0.1:" + std::to_string(p0), "--upstream", "http://127.0.0.1:" + std::to_string(p1),
                               "--probe-interval", "0.2", "--probe-timeout", "0.5", "--eject-after", "2",
                               "--eject-cooldown", "0.5", "--recover-after", "1", "--reconcile-interval", "0.5",
                               "--connect-timeout", "1"});
  auto line = proxy.read_line(30);
  ASSERT_TRUE(line) << proxy.stderr_text();
  const std::string listen = json::parse(*line)["listening"];
  const auto pp = static_cast<std::uint16_t>(std::stoi(listen.substr(listen.rfind(':') + 1)));

  // Temperature-0 answers through the proxy equal direct ones.
  json greedy = {{"model", "tiny"}, {"prompt", {1, 2, 3, 4}}, {"max_tokens", 6}, {"temperature", 0}};
  auto via = json::parse(http_request(pp, "POST", "/v1/completions", greedy.dump()).body);
  auto direct = json::parse(http_request(p0, "POST", "/v1/completions", greedy.dump()).body);
  EXPECT_EQ(via["choices"][0]["text"], direct["choices"][0]["text"]);

  // An adapter load through the proxy reaches both replicas.
  auto load = http_request(pp, "POST", "/v1/load_lora_adapter",
                           json{{"lora_name", "policy-v1"}, {"lora_path", (adapters / "policy-v1").string()}}.dump());
  ASSERT_EQ(load.status, 200) << load.body;
  for (auto port : {p0, p1})
    EXPECT_NE(http_request(port, "GET", "/v1/models").body.find("policy-v1"), std::string::npos);

  // A GRPO trace (template + problem, G = 8 requests of n = 1 each), one request at a time.
  std::mt19937 rng(3);
  std::vector<int> tmpl(32);
  for (auto& t : tmpl) t = static_cast<int>(rng() % 150000);
  const int G = 8, P = 24;
  for (int i = 0; i < P; ++i) {
    auto prompt = tmpl;
    for (int k = 0; k < 16 + static_cast<int>(rng() % 48); ++k) prompt.push_back(static_cast<int>(rng() % 150000));
    for (int g = 0; g < G; ++g) {
      auto res = http_request(pp, "POST", "/v1/completions",
                              json{{"model", "policy-v1"}, {"prompt", prompt}, {"max_tokens", 2}, {"seed", g}}.dump());
      ASSERT_EQ(res.status, 200) << res.body;
      EXPECT_EQ(json::parse(res.body)["lorasync"]["adapter"], "policy-v1");
    }
  }
  auto st = stats(pp);
  const double routed = st["router"]["routed"].get<double>();
  const double unmatched = st["router"]["unmatched"].get<double>() / routed;
  EXPECT_NEAR(unmatched, 1.0 / G, 0.02) << st["router"].dump();

  // Kill replica 1 while clients keep sending: every request succeeds (retried before any byte).
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, bad{0};
  std::thread client([&] {
    while (!stop) {
      auto res = http_request(pp, "POST", "/v1/completions",
                              json{{"model", "policy-v1"}, {"prompt", {7, 8, 9}}, {"max_tokens", 3}}.dump());
      (res.status == 200 ? ok : bad)++;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  rep1->kill(SIGKILL);
  rep1->wait_exit(10);
  const auto killed_at = std::chrono::steady_clock::now();
  std::string state;
  while (std::chrono::steady_clock::now() - killed_at < std::chrono::seconds(5)) {
    state = stats(pp)["upstreams"][1]["state"].get<std::string>();
    if (state != "in_service") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const double out_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_NE(state, "in_service");
  EXPECT_LT(out_after, 1.0) << "replica 1 still in service " << out_after << " s after it died";
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto routed_to_1 = stats(pp)["upstreams"][1]["routed"].get<int>();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(stats(pp)["upstreams"][1]["routed"].get<int>(), routed_to_1) << "traffic still sent to the dead replica";

  // Bring it back on the same port, without adapters: the proxy re-syncs it before routing to it.
  std::uint16_t p1b = 0;
  rep1 = start_replica(model, adapters, p1, &p1b);
  ASSERT_EQ(p1b, p1);
  const auto back_at = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - back_at < std::chrono::seconds(20) &&
         stats(pp)["upstreams"][1]["state"] != "in_service")
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(stats(pp)["upstreams"][1]["state"], "in_service");
  EXPECT_NE(http_request(p1, "GET", "/v1/models").body.find("policy-v1"), std::string::npos)
      << "the restarted replica serves without the current adapter";
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  stop = true;
  client.join();
  EXPECT_EQ(bad.load(), 0) << ok.load() << " ok";
  EXPECT_GT(ok.load(), 5);
  // The replica's own log: the adapter load came before any completion.
  const std::string log = rep1->stderr_text();
  const auto load_pos = log.find("adapter policy-v1");
  EXPECT_NE(load_pos, std::string::npos) << log.substr(0, 2000);
  proxy.kill(SIGTERM);
  EXPECT_EQ(proxy.wait_exit(30), std::optional<int>(0));
}

// A replica killed in the middle of a streamed response: the client's stream ends at once without
// a valid end (no [DONE], connection closed), nothing hangs, and the next requests succeed on the
// other replica.
TEST(ProxyWithRealReplicas, ReplicaKilledMidStreamEndsTheStreamWithoutHanging) {
  TempDir dir("lorasync-proxy-midstream");
  auto model = dir.path() / "tiny";
  auto r = testing::run_lorasync("init-model --preset tiny --seed 4 --output " + testing::shell_quote(model.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::uint16_t ports[2] = {0, 0};
  std::unique_ptr<testing::ChildProcess> reps[2];
  for (int i = 0; i < 2; ++i) reps[i] = start_replica(model, dir.path(), 0, &ports[i]);
  testing::ChildProcess proxy({LORASYNC_BINARY, "proxy", "--listen", "127.0.0.1:0", "--upstream",
                               "http://127.0.0.1:" + std::to_string(ports[0]), "--upstream",
                               "http://127.0.0.1:" + std::to_string(ports[1]), "--probe-interval", "0.2",
                               "--eject-after", "2", "--connect-timeout", "1"});
  auto line = proxy.read_line(30);
  ASSERT_TRUE(line) << proxy.stderr_text();
  const std::string listen = json::parse(*line)["listening"];
  const auto pp = static_cast<std::uint16_t>(std::stoi(listen.substr(listen.rfind(':') + 1)));
  // A long stream, read by hand: headers first (which replica answers), then kill that replica.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(pp);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  timeval tv{20, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const std::string body = json{{"model", "tiny"}, {"prompt", {1, 2, 3}}, {"max_tokens", 400}, {"stream", true},
                                {"ignore_eos", true}}.dump();
  const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: "
                          "application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  std::string got;
  char buf[4096];
  while (got.find("data: ") == std::string::npos) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0) << got;
    got.append(buf, static_cast<std::size_t>(n));
  }
  auto h = got.find("X-Proxy-Upstream: ");
  ASSERT_NE(h, std::string::npos) << got.substr(0, 400);
  const int victim = got[h + 18] - '0';
  ASSERT_TRUE(victim == 0 || victim == 1);
  reps[victim]->kill(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, 5.0) << "the client was left hanging";
  EXPECT_EQ(got.find("[DONE]"), std::string::npos) << "a truncated stream must not look complete";
  // Later requests succeed on the surviving replica.
  for (int i = 0; i < 5; ++i) {
    auto res = http_request(pp, "POST", "/v1/completions", json{{"model", "tiny"}, {"prompt", {4, 5}}, {"max_tokens", 2}}.dump());
    EXPECT_EQ(res.status, 200) << res.body;
  }
}

}  // namespace
}  // namespace lorasync
