// Adapter push (docs/http-api.md): on one `lorasync serve` (prepare / commit / abort, one-phase
// push, every refusal leaving no slot used and no name visible, a chunked upload, the body limit)
// and through `lorasync proxy` in front of two replicas (all-or-nothing: a refusal on one replica
// aborts the prepared copy on the other; a replica that is down is skipped and, when it comes
// back, re-synced from the proxy's copy of the bytes before it serves).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "core/io/adapter_manifest.h"
#include "util/child_process.h"
#include "util/files.h"
#include "util/http_client.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using nlohmann::json;
using testing::http_request;

constexpr const char* kPush = "/v1/lorasync/adapters/push";
constexpr const char* kPrepare = "/v1/lorasync/adapters/prepare";

std::unique_ptr<testing::ChildProcess> start_replica(const fs::path& model, std::uint16_t port, std::uint16_t* out_port,
                                                     int max_loras = 3) {
  auto p = std::make_unique<testing::ChildProcess>(std::vector<std::string>{
      LORASYNC_BINARY, "serve", "--model", model.string(), "--served-model-name", "tiny", "--port", std::to_string(port),
      "--kv-cache-memory", "32MiB", "--max-model-len", "256", "--max-loras", std::to_string(max_loras), "--max-lora-rank", "8"});
  auto line = p->read_line(60);
  if (!line) throw std::runtime_error("replica did not start: " + p->stderr_text());
  *out_port = static_cast<std::uint16_t>(json::parse(*line)["port"].get<int>());
  return p;
}

struct Fixture {
  TempDir dir{"lorasync-push"};
  fs::path model = dir.path() / "tiny";
  Fixture() {
    auto r = testing::run_lorasync("init-model --preset tiny --seed 4 --init-std 0.1 --output " +
                                   testing::shell_quote(model.string()));
    if (r.exit_code != 0) throw std::runtime_error(r.err);
  }
  // An adapter version made by init-adapter (PEFT files + manifest), as a push body.
  std::string bundle(const std::string& name, int seed, const std::string& lora_path = "") const {
    const fs::path d = dir.path() / ("src-" + name + "-" + std::to_string(seed));
    if (!fs::exists(d)) {
      auto r = testing::run_lorasync("init-adapter --model " + testing::shell_quote(model.string()) + " --output " +
                                     testing::shell_quote(d.string()) + " --rank 4 --alpha 8 --b-std 0.2 --seed " +
                                     std::to_string(seed));
      if (r.exit_code != 0) throw std::runtime_error(r.err);
    }
    std::map<std::string, std::string> files;
    for (const char* f : {"adapter_config.json", "adapter_model.safetensors"}) files[f] = read_file(d / f);
    return io::make_adapter_bundle(name, lora_path, read_file(d / "manifest.json"), files);
  }
};

bool lists(std::uint16_t port, const std::string& name) {
  auto j = json::parse(http_request(port, "GET", "/v1/models").body);
  for (const auto& m : j["data"])
    if (m["id"] == name) return true;
  return false;
}

std::int64_t prepared_slots(std::uint16_t port) {
  const std::string m = http_request(port, "GET", "/metrics").body;
  const std::string key = "\nlorasync_server_adapters_prepared ";
  const auto at = m.find(key);
  if (at == std::string::npos) return -1;
  return std::stoll(m.substr(at + key.size()));
}

// A push sent with Transfer-Encoding: chunked, in pieces of `chunk` bytes.
testing::HttpResult chunked_post(std::uint16_t port, const std::string& path, const std::string& body, std::size_t chunk) {
  testing::HttpResult r;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return r;
  }
  std::string req = "POST " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/octet-stream\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n";
  for (std::size_t off = 0; off < body.size(); off += chunk) {
    const std::size_t n = std::min(chunk, body.size() - off);
    char hex[32];
    std::snprintf(hex, sizeof hex, "%zx\r\n", n);
    req += hex + body.substr(off, n) + "\r\n";
  }
  req += "0\r\n\r\n";
  for (std::size_t off = 0; off < req.size();) {
    ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;
    off += static_cast<std::size_t>(n);
  }
  std::string raw;
  char buf[65536];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) raw.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  if (raw.size() > 12) r.status = std::stoi(raw.substr(9, 3));
  const auto he = raw.find("\r\n\r\n");
  if (he != std::string::npos) r.body = raw.substr(he + 4);
  return r;
}

TEST(AdapterPush, OneServerPreparesCommitsAbortsAndRefusesWithoutSideEffects) {
  Fixture fx;
  std::uint16_t port = 0;
  auto rep = start_replica(fx.model, 0, &port);
  auto info = json::parse(http_request(port, "GET", "/server_info").body);
  EXPECT_EQ(info["adapter_push"], "lorasync-push/1");

  // Prepare: a slot holds it, nobody sees it.
  const std::string v1 = fx.bundle("policy-v1", 1);
  auto r = http_request(port, "POST", kPrepare, v1);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["status"], "prepared");
  EXPECT_FALSE(lists(port, "policy-v1"));
  EXPECT_EQ(prepared_slots(port), 1);
  EXPECT_EQ(http_request(port, "POST", "/v1/completions", json{{"model", "policy-v1"}, {"prompt", {1, 2}}, {"max_tokens", 2}}.dump()).status,
            404);
  // Commit: visible and serving, with the manifest's identity.
  r = http_request(port, "POST", "/v1/lorasync/adapters/commit", json{{"lora_name", "policy-v1"}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(json::parse(r.body)["created"].get<bool>());
  EXPECT_TRUE(lists(port, "policy-v1"));
  EXPECT_EQ(prepared_slots(port), 0);
  auto c = http_request(port, "POST", "/v1/completions", json{{"model", "policy-v1"}, {"prompt", {1, 2}}, {"max_tokens", 2}}.dump());
  ASSERT_EQ(c.status, 200) << c.body;
  const auto manifest_sha = io::parse_adapter_bundle(v1).adapter_sha256;
  EXPECT_EQ(json::parse(c.body)["lorasync"]["adapter_sha256"], manifest_sha);

  // Abort frees a prepared slot; abort is idempotent; commit of nothing is 404.
  ASSERT_EQ(http_request(port, "POST", kPrepare, fx.bundle("policy-v2", 2)).status, 200);
  r = http_request(port, "POST", "/v1/lorasync/adapters/abort", json{{"lora_name", "policy-v2"}}.dump());
  EXPECT_EQ(json::parse(r.body)["status"], "aborted");
  r = http_request(port, "POST", "/v1/lorasync/adapters/abort", json{{"lora_name", "policy-v2"}}.dump());
  EXPECT_EQ(json::parse(r.body)["status"], "not_prepared");
  EXPECT_EQ(http_request(port, "POST", "/v1/lorasync/adapters/commit", json{{"lora_name", "policy-v2"}}.dump()).status, 404);
  EXPECT_EQ(prepared_slots(port), 0);

  // Refusals: each names the problem and leaves no slot used, no name visible.
  const std::string v3 = fx.bundle("policy-v3", 3);
  struct Bad {
    std::string body;
    int status;
    std::string says;
  };
  std::string flipped = v3;
  flipped[flipped.size() - 7] ^= 0x20;
  std::vector<Bad> bad = {
      {v3.substr(0, v3.size() - 100), 400, "truncated or padded"},
      {v3 + "trailing", 400, "truncated or padded"},
      {flipped, 400, "SHA-256"},
      {"{\"format\": \"lorasync-push/9\"}\n", 400, "format"},
      {fx.bundle("policy-v1", 9), 409, "other content"},  // a loaded name with other bytes
  };
  for (const auto& b : bad) {
    auto res = http_request(port, "POST", kPrepare, b.body);
    EXPECT_EQ(res.status, b.status) << res.body;
    EXPECT_NE(res.body.find(b.says), std::string::npos) << res.body;
    res = http_request(port, "POST", kPush, b.body);
    EXPECT_EQ(res.status, b.status) << res.body;
  }
  EXPECT_FALSE(lists(port, "policy-v3"));
  EXPECT_EQ(prepared_slots(port), 0);
  EXPECT_EQ(json::parse(http_request(port, "GET", "/v1/models").body)["data"].size(), 2u);  // base + policy-v1

  // A body over the push limit: 413 before it is read (Content-Length says so).
  auto big = http_request(port, "POST", kPush, std::string(40u << 20, 'x'));
  EXPECT_TRUE(big.status == 413 || big.status == 0) << big.status;  // 0: the server closed while we sent
  // A chunked (streamed) upload works like a sized one; one-phase push serves at once.
  auto ch = chunked_post(port, kPush, v3, 64 * 1024);
  ASSERT_EQ(ch.status, 200) << ch.body;
  EXPECT_TRUE(lists(port, "policy-v3"));
  // Pushing the same bytes again is idempotent.
  r = http_request(port, "POST", kPush, v3);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_FALSE(json::parse(r.body)["created"].get<bool>());
  // The server is undisturbed.
  EXPECT_EQ(http_request(port, "POST", "/v1/completions", json{{"model", "tiny"}, {"prompt", {1, 2}}, {"max_tokens", 2}}.dump()).status,
            200);
}

TEST(AdapterPush, ThroughTheProxyAllOrNothingAndRejoinFromTheProxysCopy) {
  Fixture fx;
  std::uint16_t p0 = 0, p1 = 0;
  auto rep0 = start_replica(fx.model, 0, &p0);
  auto rep1 = start_replica(fx.model, 0, &p1);
  testing::ChildProcess proxy({LORASYNC_BINARY, "proxy", "--listen", "127.0.0.1:0", "--upstream",
                               "http://127.0.0.1:" + std::to_string(p0), "--upstream", "http://127.0.0.1:" + std::to_string(p1),
                               "--probe-interval", "0.2", "--probe-timeout", "0.5", "--eject-after", "2",
                               "--eject-cooldown", "0.5", "--recover-after", "1", "--reconcile-interval", "0",
                               "--connect-timeout", "1"});
  // (No reconciliation: the test plants a conflicting adapter on one replica on purpose.)
  auto line = proxy.read_line(30);
  ASSERT_TRUE(line) << proxy.stderr_text();
  const std::string listen = json::parse(*line)["listening"];
  const auto pp = static_cast<std::uint16_t>(std::stoi(listen.substr(listen.rfind(':') + 1)));
  auto stats = [&] { return json::parse(http_request(pp, "GET", "/proxy/stats").body); };

  // A push reaches both replicas and serves through the proxy.
  auto r = http_request(pp, "POST", kPush, fx.bundle("policy-v1", 1));
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = json::parse(r.body);
  EXPECT_EQ(j["succeeded"], 2);
  EXPECT_TRUE(j["phases_ms"].contains("prepare"));
  EXPECT_TRUE(lists(p0, "policy-v1") && lists(p1, "policy-v1"));
  EXPECT_EQ(http_request(pp, "POST", "/v1/completions", json{{"model", "policy-v1"}, {"prompt", {3, 4}}, {"max_tokens", 2}}.dump()).status,
            200);
  // The proxy does not take the phases from a client.
  EXPECT_EQ(http_request(pp, "POST", kPrepare, fx.bundle("policy-v2", 2)).status, 404);
  // A bundle whose framing is wrong never reaches a replica.
  r = http_request(pp, "POST", kPush, "not a bundle");
  EXPECT_EQ(r.status, 400);

  // One replica refuses (it holds policy-v2 with other bytes): nothing becomes visible anywhere,
  // the other replica's prepared copy is aborted, the caller gets that replica's reason.
  ASSERT_EQ(http_request(p1, "POST", kPush, fx.bundle("policy-v2", 22)).status, 200);
  r = http_request(pp, "POST", kPush, fx.bundle("policy-v2", 2));
  EXPECT_EQ(r.status, 409) << r.body;
  EXPECT_NE(r.body.find("aborted on the others"), std::string::npos) << r.body;
  EXPECT_FALSE(lists(p0, "policy-v2"));
  EXPECT_EQ(prepared_slots(p0), 0);
  EXPECT_EQ(prepared_slots(p1), 0);
  ASSERT_EQ(http_request(p1, "POST", "/v1/unload_lora_adapter", json{{"lora_name", "policy-v2"}}.dump()).status, 200);

  // Replica 1 down: the push commits on replica 0 and skips it; back on the same port and empty,
  // it is re-synced from the proxy's copy (no lora_path: only the bytes exist) before it serves.
  rep1->kill(SIGKILL);
  rep1->wait_exit(10);
  for (int i = 0; i < 100 && stats()["upstreams"][1]["state"] == "in_service"; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  r = http_request(pp, "POST", kPush, fx.bundle("policy-v3", 3));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(lists(p0, "policy-v3"));
  std::uint16_t p1b = 0;
  rep1 = start_replica(fx.model, p1, &p1b);
  ASSERT_EQ(p1b, p1);
  for (int i = 0; i < 400 && stats()["upstreams"][1]["state"] != "in_service"; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_EQ(stats()["upstreams"][1]["state"], "in_service");
  EXPECT_TRUE(lists(p1, "policy-v1"));
  EXPECT_TRUE(lists(p1, "policy-v3"));
  const std::string log = rep1->stderr_text();
  EXPECT_NE(log.find("adapter policy-v3 loaded by push"), std::string::npos) << log.substr(0, 3000);
  proxy.kill(SIGTERM);
}

}  // namespace
}  // namespace lorasync
