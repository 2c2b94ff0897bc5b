// tests/integration/train_fakes.h: fake generation servers and a tiny training run for the
// trainer's integration tests (train_faults_test.cpp, train_dp_test.cpp).
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <string>

#include "core/tokenizer/tokenizer.h"
#include "http/server.h"
#include "util/files.h"
#include "util/hold.h"
#include "util/run_command.h"

namespace lorasync::testing {

using nlohmann::json;

// A fake generation server: the control routes of a replica (health, capabilities, models,
// adapter loads that read the manifest for the provenance check, `max_loras` slots: a load past
// them answers 507 as serve does); completions() is the test's, and hold_s() may hold a completion
// (asynchronously, as a long generation) until the client leaves or the hold ends.
class FakeReplica {
 public:
  virtual ~FakeReplica() { stop(); }
  std::uint16_t port() const { return server_->port(); }
  // Loads refused because every slot was taken; held completions whose client left (cancelled).
  int slot_refusals() const {
    std::lock_guard lk(mu_);
    return slot_refusals_;
  }
  int cancelled_while_held() const {
    std::lock_guard lk(mu_);
    return cancelled_while_held_;
  }
  int most_loaded() const {
    std::lock_guard lk(mu_);
    return most_loaded_;
  }

 protected:
  explicit FakeReplica(int max_loras = 8) : max_loras_(max_loras) {}
  // Called with the replica's lock held; `sha` is the loaded adapter's digest ("" if none).
  virtual http::Response completions(const json& body, const std::string& model, const std::string& sha) = 0;
  // Called with the lock held, before completions(): seconds to hold this request (0: answer now).
  virtual double hold_s(const json& /*body*/, const std::string& /*model*/) { return 0; }
  // Called with the lock held: seconds to hold the answer to a load of adapter `name` (0: now).
  virtual double load_hold_s(const std::string& /*name*/) { return 0; }
  void start() {
    server_ = std::make_unique<http::Server>(http::ServerOptions{}, [this](http::Request& req, http::ResponseWriter& w) -> http::Task<void> {
      double hold = 0;
      http::Response r = handle(req, hold);
      if (hold > 0 && !co_await held(hold, w)) co_return;  // the client left: nothing to answer
      co_await w.send(std::move(r));
    });
    server_->start();
  }
  void stop() {
    if (server_) server_->stop(1.0);
  }

 private:
  // Holds for `hold` seconds unless the client leaves; false (and counted) if it did.
  http::Task<bool> held(double hold, http::ResponseWriter& w) {
    const bool stayed = co_await hold_unless_client_leaves(w, hold);
    std::lock_guard lk(mu_);
    cancelled_while_held_ += !stayed;
    co_return stayed;
  }

  http::Response handle(const http::Request& req, double& hold) {
    const std::string path(req.path());
    std::lock_guard lk(mu_);
    if (path == "/health") return http::json_response(200, "{}");
    if (path == "/server_info")
      return http::json_response(200, json{{"model", "tiny"}, {"dtype", "float32"}, {"max_model_len", 2048},
                                           {"lora_config", {{"max_loras", max_loras_}, {"max_lora_rank", 16}}},
                                           {"parallel_config", {{"data_parallel_size", 1}}}}
                                          .dump());
    if (path == "/v1/models") {
      json data = json::array({{{"id", "tiny"}}});
      for (const auto& [n, sha] : loaded_) data.push_back({{"id", n}});
      return http::json_response(200, json{{"data", data}}.dump());
    }
    json body = json::parse(req.body, nullptr, false);
    if (path == "/v1/load_lora_adapter") {
      auto m = json::parse(read_file(fs::path(body["lora_path"].get<std::string>()) / "manifest.json"));
      const std::string name = body["lora_name"];
      if (!loaded_.count(name) && static_cast<int>(loaded_.size()) >= max_loras_) {
        ++slot_refusals_;
        return http::json_response(507, json{{"error", {{"message", fmt::format("all {} adapter slots are in use (scripted)", max_loras_)}}}}.dump());
      }
      loaded_[name] = m["adapter_sha256"];
      most_loaded_ = std::max(most_loaded_, static_cast<int>(loaded_.size()));
      hold = load_hold_s(name);
      return http::json_response(200, "\"ok\"");
    }
    if (path == "/v1/unload_lora_adapter") {
      loaded_.erase(body["lora_name"].get<std::string>());
      return http::json_response(200, "\"ok\"");
    }
    if (path != "/v1/completions") return http::json_response(404, "{}");
    const std::string model = body["model"];
    hold = hold_s(body, model);
    return completions(body, model, loaded_.count(model) ? loaded_[model] : "");
  }

  mutable std::mutex mu_;
  std::map<std::string, std::string> loaded_;
  int max_loras_;
  int slot_refusals_ = 0, cancelled_while_held_ = 0, most_loaded_ = 0;
  std::unique_ptr<http::Server> server_;
};

// A server whose answer is a function of the request alone (not of time, order or adapter): for
// "What is N + 1?" member k answers \boxed{N+1} or, for every third (N, k), \boxed{N+2}; fixed
// logprobs. Adapters are "loaded" by reading their manifest (for the provenance check).
class DeterministicServer : public FakeReplica {
 public:
  // fail_prompt >= 0: the first `fail_count` requests for that problem answer 503.
  explicit DeterministicServer(int fail_prompt = -1, int fail_count = 0, int max_loras = 8)
      : FakeReplica(max_loras), fail_prompt_(fail_prompt), fail_count_(fail_count),
        tok_(tok::Tokenizer::load(fs::path(LORASYNC_SHARED_DIR) / "data" / "qwen2-tokenizer")) {
    start();
  }
  ~DeterministicServer() override { stop(); }

 protected:
  // N of the request's "What is N + 1?" (-1 if the prompt is not one).
  int problem_of(const json& body) const {
    const std::string prompt = tok_.decode(body["prompt"].get<std::vector<std::int32_t>>());
    std::smatch m;
    if (!std::regex_search(prompt, m, std::regex(R"(What is (\d+) \+ 1)"))) return -1;
    return std::stoi(m[1]);
  }
  http::Response completions(const json& body, const std::string& model, const std::string& sha) override {
    const int n = problem_of(body);
    if (n < 0) return http::json_response(400, "{}");
    if (n == fail_prompt_ && fail_count_ > 0) {
      --fail_count_;
      return http::json_response(503, R"x({"error":{"message":"overloaded (scripted)"}})x");
    }
    json choices = json::array();
    for (int k = 0; k < body["n"].get<int>(); ++k) {
      const auto ids = tok_.encode("\\boxed{" + std::to_string((n + k) % 3 == 0 ? n + 2 : n + 1) + "}");
      std::vector<double> lps(ids.size(), -0.3 - 0.05 * k);
      choices.push_back({{"index", k}, {"text", ""}, {"finish_reason", "stop"}, {"token_ids", ids},
                         {"logprobs", {{"token_logprobs", lps}}}});
    }
    return http::json_response(200, json{{"model", model}, {"choices", choices},
                                         {"lorasync", {{"adapter", model}, {"adapter_sha256", sha}}}}
                                        .dump());
  }

  int fail_prompt_, fail_count_;
  tok::Tokenizer tok_;
};

// A tiny model, 12 problems and a configuration against the fake; `extra` is appended TOML.
struct TrainRun {
  TempDir dir{"lorasync-train-faults"};
  fs::path model = dir.path() / "tiny", out = dir.path() / "run", config = dir.path() / "t.toml";
  TrainRun(std::uint16_t port, int max_steps, const std::string& grpo_extra = "", const std::string& extra = "") {
    auto r = testing::run_lorasync("init-model --preset tiny --seed 5 --init-std 0.1 --tokenizer " +
                                   testing::shell_quote(std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer") +
                                   " --output " + testing::shell_quote(model.string()));
    if (r.exit_code != 0) throw std::runtime_error(r.err);
    {
      std::ofstream f(dir.path() / "train.jsonl");
      for (int i = 0; i < 12; ++i) f << json{{"problem", "What is " + std::to_string(i) + " + 1?"}, {"answer", std::to_string(i + 1)}}.dump() << "\n";
    }
    std::ofstream(config)
        << "output_dir = \"" << out.string() << "\"\nmax_steps = " << max_steps << "\n"
        << "[model]\npath = \"" << model.string() << "\"\nserved_name = \"tiny\"\ndevice = \"cpu\"\ndtype = \"fp32\"\nthreads = 1\n"
        << "[lora]\nrank = 4\nalpha = 8.0\n[data]\nmax_prompt_tokens = 200\ntrain_file = \"" << (dir.path() / "train.jsonl").string() << "\"\n"
        << "[generation]\nserver_url = \"http://127.0.0.1:" << port << "\"\nmax_new_tokens = 8\ncontext_len = 1024\nserver_wait_s = 10\n"
        << "[grpo]\nnum_generations = 4\n" << grpo_extra
        << "[async]\nmax_inflight = 8\nqueue_maxsize = 32\nscore_workers = 1\nmax_staleness = 1\n"
        << "retry_backoff_s = 0.01\nretry_backoff_max_s = 0.05\nmax_retries = 8\n"
        << "[batching]\nsamples_per_step = 8\nrow_tokens = 2048\n[sync]\nweight_sync_steps = 2\n"
        << "[checkpoint]\nsave_steps = 100\n[logging]\nmetrics_port = 0\n" << extra;
  }
};

// Replaces `from` (which must occur) by `to` in the file at `path`.
inline void patch_file(const fs::path& path, const std::string& from, const std::string& to) {
  std::string text = read_file(path);
  const auto at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  text.replace(at, from.size(), to);
  write_file_atomic(path, text);
}

}  // namespace lorasync::testing
