// Soak (label slow): many concurrent clients with random lengths, mixed base/adapters, streaming
// and not, while adapters are loaded and unloaded in between. Bounded in time; the server must
// answer every request correctly (each body checked against its request: completion_check.h) and
// its memory must stay bounded.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <fstream>
#include <random>
#include <thread>

#include "completion_check.h"
#include "core/model/model_config.h"
#include "test_adapters.h"
#include "util/child_process.h"
#include "util/files.h"
#include "util/http_client.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using nlohmann::json;

long rss_kb(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return 0;
}

TEST(ServeSoak, ConcurrentClientsWithAdapterChurn) {
  TempDir dir("lorasync-soak");
  auto model = dir.path() / "tiny";
  auto r = testing::run_lorasync("init-model --preset tiny --output " + testing::shell_quote(model.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto cfg = model::ModelConfig::load(model);
  auto make = [&](const std::string& name, std::uint64_t seed) { return testing::write_test_adapter(dir.path(), name, seed, cfg); };
  testing::ChildProcess srv({LORASYNC_BINARY, "serve", "--model", model.string(), "--served-model-name", "tiny",
                             "--port", "0", "--kv-cache-memory", "8MiB", "--max-model-len", "384",
                             "--max-lora-rank", "8", "--max-num-seqs", "32", "--max-loras", "5"});
  auto line = srv.read_line(60);
  ASSERT_TRUE(line) << srv.stderr_text();
  const auto port = static_cast<std::uint16_t>(json::parse(*line)["port"].get<int>());
  for (const char* n : {"stable-a", "stable-b"})
    ASSERT_EQ(testing::http_request(port, "POST", "/v1/load_lora_adapter",
                                    json{{"lora_name", n}, {"lora_path", make(n, std::hash<std::string>{}(n) % 1000)}}.dump()).status, 200);
  std::vector<std::string> churn_paths;
  for (int v = 0; v < 6; ++v) churn_paths.push_back(make("churn-v" + std::to_string(v), 50 + static_cast<std::uint64_t>(v)));

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::atomic<int> ok{0}, failed{0}, churn_404{0};
  std::atomic<int> current_churn{-1};
  std::mutex err_mu;
  std::string first_error;
  auto client = [&](int id) {
    std::mt19937 rng(static_cast<unsigned>(id));
    int done = 0;
    while (std::chrono::steady_clock::now() < deadline && done < 400) {
      ++done;
      const int which = static_cast<int>(rng() % 4);
      std::string model_name = which == 0 ? "tiny" : which == 1 ? "stable-a" : which == 2 ? "stable-b" : "";
      const int churn = current_churn.load();
      if (which == 3) {
        if (churn < 0) continue;
        model_name = "churn-v" + std::to_string(churn);
      }
      std::vector<int> prompt(1 + rng() % 200);
      for (auto& t : prompt) t = static_cast<int>(rng() % 150000);
      json req = {{"model", model_name}, {"prompt", prompt}, {"max_tokens", 1 + rng() % 40},
                  {"temperature", (rng() % 2) ? 0.0 : 1.0}, {"n", 1 + rng() % 3}, {"stream", rng() % 2 == 0},
                  {"return_token_ids", true}};
      if (req["stream"] == true) req["stream_options"] = {{"include_usage", done % 2 == 0}};
      auto res = testing::http_request(port, "POST", "/v1/completions", req.dump());
      std::string problem;
      if (res.status == 200) {
        problem = testing::completion_problem(req, res.body, "tiny");
        if (problem.empty()) ++ok;
      } else if (res.status == 404 && which == 3 && res.body.find(model_name) != std::string::npos) {
        ++churn_404;  // that version was just unloaded: the documented answer
      } else {
        problem = "status " + std::to_string(res.status);
      }
      if (!problem.empty()) {
        ++failed;
        std::lock_guard<std::mutex> lk(err_mu);
        if (first_error.empty()) first_error = problem + ": " + res.body.substr(0, 600) + " for " + req.dump().substr(0, 300);
      }
    }
  };
  std::vector<std::thread> clients;
  for (int i = 0; i < 12; ++i) clients.emplace_back(client, i);
  // Adapter churn: load v, switch clients to it, unload v-2.
  long rss_start = 0;
  for (int v = 0; v < 6 && std::chrono::steady_clock::now() < deadline; ++v) {
    auto res = testing::http_request(port, "POST", "/v1/load_lora_adapter",
                                     json{{"lora_name", "churn-v" + std::to_string(v)}, {"lora_path", churn_paths[static_cast<std::size_t>(v)]}}.dump());
    EXPECT_EQ(res.status, 200) << res.body;
    current_churn = v;
    if (v >= 2) {
      EXPECT_EQ(testing::http_request(port, "POST", "/v1/unload_lora_adapter",
                                      json{{"lora_name", "churn-v" + std::to_string(v - 2)}}.dump()).status, 200);
    }
    if (v == 1) rss_start = rss_kb(srv.pid());
    std::this_thread::sleep_for(std::chrono::seconds(6));
  }
  for (auto& t : clients) t.join();
  const long rss_end = rss_kb(srv.pid());
  EXPECT_EQ(failed.load(), 0) << first_error;
  EXPECT_GT(ok.load(), 100);
  EXPECT_EQ(testing::http_request(port, "GET", "/health").status, 200);
  // Memory bounded: the KV pool is preallocated; allow allocator noise.
  EXPECT_LT(rss_end - rss_start, 200 * 1024) << "RSS grew from " << rss_start << " kB to " << rss_end << " kB";
  // Every request has been answered: the engine drains to zero running sequences.
  std::string metrics;
  for (int i = 0; i < 50; ++i) {
    metrics = testing::http_request(port, "GET", "/metrics").body;
    if (metrics.find("lorasync_server_requests_running 0") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(metrics.find("lorasync_server_requests_running 0"), std::string::npos) << metrics.substr(0, 400);
  srv.kill(SIGTERM);
  EXPECT_EQ(srv.wait_exit(30), std::optional<int>(0));
  std::printf("soak: %d ok, %d churn 404, RSS %ld -> %ld kB\n", ok.load(), churn_404.load(), rss_start, rss_end);
}

}  // namespace
}  // namespace lorasync
