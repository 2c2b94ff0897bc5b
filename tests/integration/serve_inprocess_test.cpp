// `lorasync serve` in process (server::ApiServer over the engine, a tiny random model): the
// concurrent paths of a replica with every thread in one process, so that scripts/sanitize runs
// them under ASan + UBSan and TSan (the asan/tsan presets; the release build runs them too).
//   - clients on several threads: base and adapters, streaming and not, n > 1, some leaving in the
//     middle of a stream, while adapters are loaded and unloaded and /health and /metrics are read;
//     every answer's body is checked against its request (completion_check.h);
//   - stop() with requests running and an adapter load racing it: every client gets a
//     whole answer (checked likewise) or a closed connection, and stop() returns.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <mutex>
#include <random>
#include <thread>

#include "core/io/checkpoint_dir.h"
#include "core/model/model_config.h"
#include "core/model/decoder_model.h"
#include "completion_check.h"
#include "server/api_server.h"
#include "util/files.h"
#include "util/http_client.h"
#include "test_adapters.h"

namespace lorasync {
namespace {

using nlohmann::json;

// A tiny random model in Hugging Face layout, with the Qwen2 tokenizer.
fs::path write_tiny_model(const fs::path& dir) {
  const fs::path out = dir / "tiny";
  fs::create_directories(out);
  const auto cfg = model::ModelConfig::preset("tiny");
  auto weights = model::random_weights(cfg, 3, at::kFloat, 0.1);
  std::vector<io::TensorToWrite> ts;
  std::vector<at::Tensor> keep;
  for (auto& [name, t] : weights) {
    keep.push_back(t.contiguous());
    const auto& c = keep.back();
    ts.push_back({name, io::DType::kF32, c.sizes().vec(),
                  {static_cast<const std::uint8_t*>(c.data_ptr()), static_cast<std::size_t>(c.nbytes())}});
  }
  io::write_weights(out, ts, 0);
  write_file_atomic(out / "config.json", cfg.to_json());
  const fs::path tok = fs::path(LORASYNC_SHARED_DIR) / "data" / "qwen2-tokenizer";
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    if (fs::exists(tok / f)) write_file_atomic(out / f, read_file(tok / f));
  return out;
}

std::string write_adapter(const fs::path& dir, const std::string& name, std::uint64_t seed) {
  return testing::write_test_adapter(dir, name, seed, model::ModelConfig::preset("tiny"));
}

server::ServeOptions tiny_options(const fs::path& model) {
  server::ServeOptions o;
  o.model_dir = model.string();
  o.served_model_name = "tiny";
  o.port = 0;
  o.device = "cpu";
  o.dtype = "float32";
  o.max_model_len = 384;
  o.max_num_seqs = 16;
  o.kv_cache_memory = "8MiB";
  o.max_loras = 5;  // two stable adapters and three of the churn (v is loaded before v-2 goes)
  o.max_lora_rank = 8;
  o.threads = 1;
  o.http_threads = 2;
  return o;
}

// Sends a streaming completion and closes the connection once `bytes` of the answer arrived
// (a client that leaves in the middle of a stream). Returns the bytes read.
std::size_t leave_mid_stream(std::uint16_t port, const std::string& body, std::size_t bytes) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  std::size_t got = 0;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                            std::to_string(body.size()) + "\r\n\r\n" + body;
    if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      while (got < bytes) {
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n <= 0) break;
        got += static_cast<std::size_t>(n);
      }
    }
  }
  ::close(fd);
  return got;
}

#ifdef LORASYNC_SANITIZED
constexpr int kRequestsPerClient = 6;  // instrumented kernels are 5-20x slower
#else
constexpr int kRequestsPerClient = 14;
#endif

TEST(ServeInProcess, ConcurrentClientsAdapterChurnAndClientsLeavingMidStream) {
  TempDir dir("lorasync-serve-inproc");
  const fs::path model = write_tiny_model(dir.path());
  server::ApiServer srv(tiny_options(model));
  srv.start();
  const std::uint16_t port = srv.port();
  for (const char* n : {"stable-a", "stable-b"})
    ASSERT_EQ(testing::http_request(port, "POST", "/v1/load_lora_adapter",
                                    json{{"lora_name", n}, {"lora_path", write_adapter(dir.path(), n, n[7] == 'a' ? 1 : 2)}}.dump())
                  .status,
              200);
  std::vector<std::string> churn_paths;
  for (int v = 0; v < 4; ++v) churn_paths.push_back(write_adapter(dir.path(), "churn-v" + std::to_string(v), 50 + static_cast<std::uint64_t>(v)));

  std::atomic<int> ok{0}, left{0}, churn_404{0}, failed{0}, current_churn{-1};
  std::mutex err_mu;
  std::string first_error;
  auto client = [&](int id) {
    std::mt19937 rng(static_cast<unsigned>(id));
    for (int i = 0; i < kRequestsPerClient; ++i) {
      const int which = static_cast<int>(rng() % 4);
      std::string name = which == 0 ? "tiny" : which == 1 ? "stable-a" : which == 2 ? "stable-b" : "";
      if (which == 3) name = current_churn < 0 ? "tiny" : "churn-v" + std::to_string(current_churn.load());
      std::vector<int> prompt(1 + rng() % 60);
      for (auto& t : prompt) t = static_cast<int>(rng() % 150000);
      const bool stream = rng() % 2 == 0;
      json req = {{"model", name}, {"prompt", prompt}, {"max_tokens", 1 + rng() % 24},
                  {"temperature", (rng() % 2) ? 0.0 : 1.0}, {"n", 1 + rng() % 3}, {"stream", stream},
                  {"logprobs", 1}, {"return_token_ids", true}};
      if (stream) req["stream_options"] = {{"include_usage", i % 2 == 0}};
      if (stream && i % 3 == 0) {
        leave_mid_stream(port, req.dump(), 200);
        ++left;
        continue;
      }
      const auto res = testing::http_request(port, "POST", "/v1/completions", req.dump());
      std::string problem;
      if (res.status == 200) {
        problem = testing::completion_problem(req, res.body, "tiny");
        if (problem.empty()) ++ok;
      } else if (res.status == 404 && name.rfind("churn-", 0) == 0 && res.body.find(name) != std::string::npos) {
        ++churn_404;  // that version was just unloaded: the documented answer
      } else {
        problem = "status " + std::to_string(res.status);
      }
      if (!problem.empty()) {
        ++failed;
        std::lock_guard lk(err_mu);
        if (first_error.empty()) first_error = problem + ": " + res.body.substr(0, 600) + " for " + req.dump().substr(0, 200);
      }
    }
  };
  std::vector<std::thread> clients;
  for (int i = 0; i < 6; ++i) clients.emplace_back(client, i);
  std::thread probes([&] {
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(testing::http_request(port, "GET", "/health").status, 200);
      EXPECT_EQ(testing::http_request(port, "GET", "/metrics").status, 200);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  // Adapter churn: load v, send clients to it, unload v-2.
  for (int v = 0; v < 4; ++v) {
    // 507 while the slot of the version unloaded last is still draining its requests: retried,
    // as the trainer does.
    testing::HttpResult res;
    for (int attempt = 0; attempt < 600; ++attempt) {
      res = testing::http_request(port, "POST", "/v1/load_lora_adapter",
                                  json{{"lora_name", "churn-v" + std::to_string(v)}, {"lora_path", churn_paths[static_cast<std::size_t>(v)]}}.dump());
      if (res.status != 507) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_EQ(res.status, 200) << res.body;
    current_churn = v;
    if (v >= 2) {
      EXPECT_EQ(testing::http_request(port, "POST", "/v1/unload_lora_adapter", json{{"lora_name", "churn-v" + std::to_string(v - 2)}}.dump()).status,
                200);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  for (auto& t : clients) t.join();
  probes.join();
  EXPECT_EQ(failed.load(), 0) << first_error;
  EXPECT_GT(ok.load(), 3 * kRequestsPerClient / 2);
  EXPECT_GT(left.load(), 0);
  // Every request has ended, those whose clients left included: the engine drains to zero.
  std::string metrics;
  for (int i = 0; i < 100; ++i) {
    metrics = testing::http_request(port, "GET", "/metrics").body;
    if (metrics.find("lorasync_server_requests_running 0") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(metrics.find("lorasync_server_requests_running 0"), std::string::npos) << metrics.substr(0, 400);
  srv.stop(5);
  std::printf("serve in process: %d ok, %d left mid-stream, %d churn 404\n", ok.load(), left.load(), churn_404.load());
}

TEST(ServeInProcess, StopWithRequestsRunningAndALoadInFlightEndsEveryOne) {
  TempDir dir("lorasync-serve-inproc-stop");
  const fs::path model = write_tiny_model(dir.path());
  const std::string adapter = write_adapter(dir.path(), "late", 7);
  server::ApiServer srv(tiny_options(model));
  srv.start();
  const std::uint16_t port = srv.port();
  std::atomic<int> whole{0}, closed{0}, other{0};
  std::mutex err_mu;
  std::string first_other;
  std::vector<std::thread> clients;
  for (int i = 0; i < 6; ++i)
    clients.emplace_back([&, i] {
      const bool stream = i % 2 == 0;
      json req = {{"model", "tiny"}, {"prompt", std::vector<int>(8, 100 + i)}, {"max_tokens", 300},
                  {"temperature", 1.0}, {"stream", stream}, {"ignore_eos", true}, {"return_token_ids", true}};
      if (stream) req["stream_options"] = {{"include_usage", true}};
      const auto res = testing::http_request(port, "POST", "/v1/completions", req.dump(), {}, 60);
      // A 200 is either a whole answer (finished within the grace period: 300 tokens, as
      // ignore_eos asks) or one the stop cut short: a stream without its [DONE], a JSON body
      // shorter than its Content-Length. The latter is a closed connection, as is no answer.
      const auto length = res.headers.find("content-length");
      const bool cut = res.status == 200 && (stream ? res.body.find("data: [DONE]") == std::string::npos
                                                    : length != res.headers.end() && res.body.size() < std::stoul(length->second));
      std::string problem;
      if (res.status == 0 || cut) {
        ++closed;
      } else if (res.status == 200 && (problem = testing::completion_problem(req, res.body, "tiny")).empty()) {
        ++whole;
      } else {
        ++other;
        std::lock_guard lk(err_mu);
        if (first_other.empty()) first_other = std::to_string(res.status) + " " + problem + ": " + res.body.substr(0, 400);
      }
    });
  std::thread loader([&] {
    testing::http_request(port, "POST", "/v1/load_lora_adapter", json{{"lora_name", "late"}, {"lora_path", adapter}}.dump(), {}, 60);
  });
  // The six requests have reached the engine (accepted) before the stop.
  auto accepted_now = [&] {
    const std::string m = testing::http_request(port, "GET", "/metrics").body;
    const std::string key = "\nlorasync_server_requests_total ";
    const std::size_t at = m.find(key);
    return at == std::string::npos ? 0.0 : std::stod(m.substr(at + key.size()));
  };
  bool accepted = false;
  for (int i = 0; i < 600 && !accepted; ++i) {
    accepted = accepted_now() >= 6;
    if (!accepted) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(accepted) << "the requests never reached the engine";
  srv.stop(0.2);
  for (auto& t : clients) t.join();
  loader.join();
  EXPECT_EQ(whole + closed, 6) << other.load() << " answered otherwise; the first: " << first_other;
  std::printf("serve in process, stop: %d whole, %d closed\n", whole.load(), closed.load());
  // After stop nothing listens any more.
  EXPECT_EQ(testing::http_request(port, "GET", "/health", "", {}, 5).status, 0);
}

}  // namespace
}  // namespace lorasync
