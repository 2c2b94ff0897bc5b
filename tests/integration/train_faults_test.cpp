// `lorasync train` against a scripted fake server (trainer.md §9 "Faults"): a server that answers
// 503, loses an adapter (404 naming a version the trainer still has loaded), sends responses whose
// provenance does not match the manifest, and finally refuses every request with a permanent 400.
// Expected: retries and rejections are counted and the run goes on; the permanent 400 stops the
// trainer with exit 1, the server's message and a checkpoint.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <thread>

#include "train_fakes.h"
#include "util/child_process.h"
#include "util/files.h"
#include "util/jsonl.h"
#include "util/run_command.h"
#include "util/strings.h"

namespace lorasync {
namespace {

using nlohmann::json;
using testing::DeterministicServer;
using testing::FakeReplica;
using testing::TrainRun;

// Completions scripted by count: 503s, 404s for loaded versions, overlong completions, provenance
// that does not match the manifest, and a permanent 400 after `fail_after` requests.
class FakeServer : public FakeReplica {
 public:
  explicit FakeServer(int fail_after) : fail_after_(fail_after) { start(); }
  ~FakeServer() override { stop(); }
  int completions() const { return completions_.load(); }

 private:
  http::Response completions(const json& body, const std::string& model, const std::string& loaded_sha) override {
    const int i = ++completions_;
    if (i > fail_after_)
      return http::json_response(400, R"x({"error":{"message":"max_tokens is too large for this deployment (scripted)"}})x");
    if (i % 5 == 2) return http::json_response(503, R"({"error":{"message":"overloaded"}})");
    if (i % 7 == 3) return http::json_response(404, json{{"error", {{"message", "The model `" + model + "` does not exist."}}}}.dump());
    json choices = json::array();
    for (int k = 0; k < body["n"].get<int>(); ++k) {
      json ids = {10 + k, 11, 12}, lps = {-1.0, -0.5 - 0.1 * k, -0.25};
      if (i % 13 == 6)  // longer than the request's max_tokens: refused by the trainer
        for (int t = 0; t < body["max_tokens"].get<int>(); ++t) ids.push_back(13), lps.push_back(-0.1);
      choices.push_back({{"index", k}, {"text", "x"}, {"finish_reason", "stop"}, {"token_ids", ids},
                         {"logprobs", {{"token_logprobs", lps}}}});
    }
    std::string sha = loaded_sha;
    if (i % 11 == 4) sha = std::string(64, '0');  // provenance that does not match the manifest
    return http::json_response(200, json{{"model", model}, {"choices", choices},
                                         {"lorasync", {{"adapter", model}, {"adapter_sha256", sha}}}}
                                        .dump());
  }

  std::atomic<int> completions_{0};
  int fail_after_;
};

TEST(TrainFaults, RetriesRejectsAndStopsOnAPermanent400WithACheckpoint) {
  FakeServer fake(/*fail_after=*/60);
  TrainRun run(fake.port(), 50);
  const fs::path& out = run.out;
  auto r = testing::run_lorasync("--log-level debug train --config " + testing::shell_quote(run.config.string()));
  EXPECT_EQ(r.exit_code, 1) << r.err.substr(r.err.size() > 20000 ? r.err.size() - 20000 : 0);
  EXPECT_NE(r.err.find("HTTP 400"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("too large for this deployment"), std::string::npos) << r.err;
  EXPECT_GE(fake.completions(), 61);
  auto metrics = testing::read_jsonl(out / "metrics.jsonl");
  ASSERT_GE(metrics.size(), 3u) << r.err;
  const auto& last = metrics.back();
  EXPECT_GT(last["rollout/retry_total"].get<int>(), 0);             // 503s and 404s of loaded versions
  EXPECT_GT(last["rollout/invalid_response_total"].get<int>(), 0);  // sha256 differs from the manifest
  EXPECT_NE(r.err.find("more than max_tokens 8"), std::string::npos);  // an overlong completion (retried)
  EXPECT_EQ(last["rollout/failed_total"], 0);
  // Exit 1 after a checkpoint at the last completed step.
  const std::string latest = read_file(out / "checkpoints" / "latest");
  EXPECT_EQ(latest, fmt::format("step-{:06d}\n", metrics.back()["step"].get<int>()));
}

// External rewards (trainer.md "External rewards"): a command reward whose workers hang on one
// call, crash on another and print garbage on a third. Each such member is excluded (NaN) and
// counted by kind; the run reaches its last step with finite rewards.
TEST(TrainFaults, ExternalRewardsThatHangCrashOrPrintGarbageAreExcludedAndCounted) {
  FakeServer fake(/*fail_after=*/100000);
  TempDir scripts("lorasync-flaky-reward");
  const fs::path script = scripts.path() / "flaky.py", counter = scripts.path() / "calls";
  std::ofstream(script) << R"PY(
import fcntl, json, os, sys, time
counter = sys.argv[1]
for line in sys.stdin:
    with open(counter, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = len(f.read()) + 1
        f.write("x")
    if n == 3: time.sleep(3600)
    if n == 6: os._exit(9)
    if n == 9: print("garbage", flush=True); continue
    c = json.loads(line)["completion"]
    print(json.dumps({"reward": (sum(map(ord, c)) % 5) / 4}), flush=True)
)PY";
  TrainRun run(fake.port(), 4, "reward_funcs = [\"flaky\"]\nreward_weights = [1.0]\n",
          "[rewards.flaky]\nkind = \"command\"\ncommand = [\"python3\", \"" + script.string() + "\", \"" +
              counter.string() + "\"]\nworkers = 2\ntimeout_s = 1.0\nstartup_s = 4\n");
  auto r = testing::run_lorasync("train --config " + testing::shell_quote(run.config.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto metrics = testing::read_jsonl(run.out / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u) << r.err;
  for (const auto& m : metrics) {
    ASSERT_TRUE(m["reward"].is_number()) << m.dump();  // never NaN (null in JSON)
    ASSERT_TRUE(m["reward_std"].is_number()) << m.dump();
  }
  const auto& last = metrics.back();
  EXPECT_EQ(last["rollout/reward_timeout_total"], 1) << last.dump();
  EXPECT_EQ(last["rollout/reward_crashed_total"], 1) << last.dump();
  EXPECT_EQ(last["rollout/reward_invalid_total"], 1) << last.dump();
  EXPECT_NE(r.err.find("reward flaky: no answer within 1 s"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("exited with status 9"), std::string::npos) << r.err;
  // The resolved configuration keeps the reward's definition (for --resume).
  EXPECT_NE(read_file(run.out / "config.toml").find("[rewards.flaky]"), std::string::npos);
  // --resume DIR with --set alone layers the overrides on the checkpoint's configuration:
  // an operational key (max_steps) continues the run; another key is refused.
  const std::string ckpt = (run.out / "checkpoints" / std::string(trim(read_file(run.out / "checkpoints" / "latest")))).string();
  auto more = testing::run_lorasync("train --resume " + testing::shell_quote(ckpt) + " --set max_steps=5");
  EXPECT_EQ(more.exit_code, 0) << more.err;
  EXPECT_EQ(testing::read_jsonl(run.out / "metrics.jsonl").back()["step"], 5) << more.err;
  auto refused = testing::run_lorasync("train --resume " + testing::shell_quote(ckpt) + " --set lora.rank=8");
  EXPECT_EQ(refused.exit_code, 2) << refused.err;
  EXPECT_NE(refused.err.find("not operational"), std::string::npos) << refused.err;
}

// SIGTERM while every reward call hangs (deadline 300 s): the trainer checkpoints and exits within
// its grace, killing the workers instead of waiting on them.
TEST(TrainFaults, SigtermNeverWaitsOnAHungReward) {
  FakeServer fake(/*fail_after=*/100000);
  TempDir scripts("lorasync-hung-reward");
  const fs::path script = scripts.path() / "hang.py";
  std::ofstream(script) << "import sys, time\nfor line in sys.stdin:\n    time.sleep(3600)\n";
  TrainRun run(fake.port(), 50, "reward_funcs = [\"stuck\"]\nreward_weights = [1.0]\n",
          "[rewards.stuck]\nkind = \"command\"\ncommand = [\"python3\", \"" + script.string() + "\"]\ntimeout_s = 300\n");
  testing::ChildProcess trainer({LORASYNC_BINARY, "train", "--config", run.config.string()});
  for (int i = 0; i < 600 && fake.completions() < 4; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_GE(fake.completions(), 4) << trainer.stderr_text();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the scorer is inside a hung call
  const auto t0 = std::chrono::steady_clock::now();
  trainer.kill(SIGTERM);
  auto code = trainer.wait_exit(30);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(code.has_value()) << "still running 30 s after SIGTERM:\n" << trainer.stderr_text();
  EXPECT_EQ(*code, 143) << trainer.stderr_text();
  EXPECT_LT(took, 15.0);
  EXPECT_TRUE(fs::exists(run.out / "checkpoints" / "latest")) << trainer.stderr_text();
}

// trainer.md §9 "Checkpoint round trip": with async.ordered and a deterministic server, 6 straight
// steps equal 3 steps + checkpoint + resume + 3 steps: bit-identical adapter and optimizer state,
// the same groups in the same order, identical metrics apart from wall-clock ones (perf/*, time,
// the rollout timings), the restart count and the version number (renumbered at a resume).
TEST(TrainFaults, OrderedRunResumesBitIdentically) {
  auto run_to = [&](TrainRun& run, int steps, bool resume) {
    const std::string cmd = "train " + std::string(resume ? "--resume " : "") + "--config " +
                            testing::shell_quote(run.config.string()) + " --set max_steps=" + std::to_string(steps);
    auto r = testing::run_lorasync(cmd);
    ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.err;
  };
  DeterministicServer fa, fb;
  TrainRun a(fa.port(), 6), b(fb.port(), 6);
  auto patch = [](std::string& text, const std::string& from, const std::string& to) {
    const auto at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
  };
  for (TrainRun* r : {&a, &b}) {
    std::string text = read_file(r->config);
    patch(text, "max_inflight = 8\nqueue_maxsize = 32\nscore_workers = 1\n",
          "ordered = true\nmax_inflight = 64\nqueue_maxsize = 64\nscore_workers = 3\n");
    patch(text, "[checkpoint]\nsave_steps = 100\n", "[checkpoint]\nsave_steps = 3\n");
    write_file_atomic(r->config, text);
  }
  run_to(a, 6, false);
  run_to(b, 3, false);
  run_to(b, 6, true);

  const fs::path ca = a.out / "checkpoints" / "step-000006", cb = b.out / "checkpoints" / "step-000006";
  ASSERT_TRUE(fs::exists(ca / "state.json")) << ca;
  ASSERT_TRUE(fs::exists(cb / "state.json")) << cb;
  int compared = 0;
  for (const auto& e : fs::recursive_directory_iterator(ca)) {
    if (!e.is_regular_file() || e.path().extension() != ".safetensors") continue;
    const fs::path other = cb / fs::relative(e.path(), ca);
    ASSERT_TRUE(fs::exists(other)) << other;
    std::string x = read_file(e.path()), y = read_file(other);
    if (e.path().filename() == "versions.safetensors") {
      // The snapshots are named by version number, which a resume renumbers: compare the data
      // (laid out in version order), not the header.
      auto data = [](const std::string& f) {
        std::uint64_t n = 0;
        std::memcpy(&n, f.data(), 8);
        return f.substr(8 + n);
      };
      x = data(x), y = data(y);
      EXPECT_FALSE(x.empty());
    }
    EXPECT_TRUE(x == y) << "differs: " << fs::relative(e.path(), ca);
    ++compared;
  }
  EXPECT_GE(compared, 2) << "adapter and optimizer tensors";
  EXPECT_TRUE(read_file(a.out / "final_adapter" / "adapter_model.safetensors") ==
              read_file(b.out / "final_adapter" / "adapter_model.safetensors"));
  auto sa = json::parse(read_file(ca / "state.json")), sb = json::parse(read_file(cb / "state.json"));
  for (const char* k : {"cursor", "counters", "optimizer_steps", "samples_since_switch", "loss_scaler"})
    EXPECT_EQ(sa[k], sb[k]) << k;

  // Metrics: the same lines, apart from wall-clock figures, restarts and the version number.
  auto comparable = [](json m) {
    for (const char* k : {"time", "restarts", "version", "rollout/generated_tok_s", "rollout/backpressure_s",
                          "rollout/score_block_s", "rollout/admission_block_s", "rollout/request_s", "rollout/score_s",
                          "sample/time_in_queue_s"})
      m.erase(k);
    for (auto it = m.begin(); it != m.end();) it = it.key().rfind("perf/", 0) == 0 ? m.erase(it) : std::next(it);
    return m;
  };
  auto ma = testing::read_jsonl(a.out / "metrics.jsonl"), mb = testing::read_jsonl(b.out / "metrics.jsonl");
  ASSERT_EQ(ma.size(), 6u);
  ASSERT_EQ(mb.size(), 6u);
  bool learned = false;
  for (std::size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(comparable(ma[i]), comparable(mb[i])) << "step " << i + 1;
    if (ma[i].contains("grad_norm") && ma[i]["grad_norm"].is_number() && ma[i]["grad_norm"].get<double>() > 0) learned = true;
  }
  EXPECT_TRUE(learned) << "the rewards must vary within groups, or the test compares zeros";
  // The groups log: the same groups trained in the same order.
  auto ga = testing::read_jsonl(a.out / "groups.jsonl"), gb = testing::read_jsonl(b.out / "groups.jsonl");
  ASSERT_EQ(ga.size(), gb.size());
  for (std::size_t i = 0; i < ga.size(); ++i) {
    EXPECT_EQ(ga[i]["prompt"], gb[i]["prompt"]) << i;
    EXPECT_EQ(ga[i]["epoch"], gb[i]["epoch"]) << i;
    EXPECT_EQ(ga[i]["sync_index"], gb[i]["sync_index"]) << i;
    EXPECT_EQ(ga[i]["mean_reward"], gb[i]["mean_reward"]) << i;
  }
}

// A group waiting to retry has no request out: version switches meanwhile must not cancel it as
// stale (it would lose an attempt for nothing; its retry names the current version). One problem
// answers 503 three times with 0.5 s backoffs (about 1.5 s) while the others train steps and
// syncs make its first version stale (max_staleness = 1); the run outlasts it (24 steps).
TEST(TrainFaults, AGroupInRetryBackoffIsNotCancelledAsStale) {
  DeterministicServer fake(/*fail_prompt=*/0, /*fail_count=*/3);
  TrainRun run(fake.port(), 24);
  std::string text = read_file(run.config);
  for (auto [from, to] : {std::pair<std::string, std::string>{"retry_backoff_s = 0.01\nretry_backoff_max_s = 0.05\n",
                                                               "retry_backoff_s = 0.5\nretry_backoff_max_s = 0.5\n"},
                          {"max_inflight = 8\n", "max_inflight = 64\n"}}) {
    ASSERT_NE(text.find(from), std::string::npos) << from;
    text.replace(text.find(from), from.size(), to);
  }
  write_file_atomic(run.config, text);
  auto r = testing::run_lorasync("train --config " + testing::shell_quote(run.config.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto last = testing::read_jsonl(run.out / "metrics.jsonl").back();
  EXPECT_EQ(last["rollout/retry_total"], 3) << last.dump();
  EXPECT_EQ(last["rollout/cancelled_stale_total"], 0) << last.dump();
  EXPECT_GE(last["sync_index"].get<int>(), 4) << last.dump();
  bool trained = false;
  for (const auto& g : testing::read_jsonl(run.out / "groups.jsonl")) {
    EXPECT_NE(g["disposition"], "cancelled") << g.dump();
    if (g["prompt"] == 0 && g["epoch"] == 0 && g["disposition"] == "trained") {
      trained = true;
      EXPECT_EQ(g["attempt"], 1) << "no attempt lost: " << g.dump();
    }
  }
  EXPECT_TRUE(trained) << read_file(run.out / "groups.jsonl");
}

// Holds the first completion of each model (base and every adapter version) until the client
// leaves: a generation still running when its version leaves the staleness window.
class HoldingServer : public DeterministicServer {
 public:
  explicit HoldingServer(int max_loras) : DeterministicServer(-1, 0, max_loras) {}
  ~HoldingServer() override { stop(); }

 private:
  double hold_s(const json& /*body*/, const std::string& model) override { return held_.insert(model).second ? 60 : 0; }
  std::set<std::string> held_;
};

// The unload race (issue 16): the switch to version v+2 cancels v's requests, and the sync must
// unload v once they have ended, before the next load needs its slot. With the fewest slots the
// probe accepts (max_loras = max_staleness + 2 = 3), a sync that checked for in-flight requests at
// once (before the cancellations were processed) kept v loaded, and the next load got 507 until its
// deadline (5 s here) ended the run. Each version's first completion is held, so at every switch
// a request of the version leaving the window is in flight.
TEST(TrainFaults, ATightSlotBudgetSurvivesCancelledRequestsOfTheVersionLeavingTheWindow) {
  HoldingServer fake(/*max_loras=*/3);
  TrainRun run(fake.port(), 12, "", "[sync]\nadapter_load_deadline = 5\nadapter_retry_interval = 0.05\n");
  testing::patch_file(run.config, "[sync]\nweight_sync_steps = 2\n", "");  // one [sync] table
  testing::patch_file(run.config, "[sync]\nadapter_load_deadline", "[sync]\nweight_sync_steps = 2\nadapter_load_deadline");
  testing::patch_file(run.config, "max_inflight = 8\n", "max_inflight = 64\n");  // held groups do not block the others
  auto r = testing::run_lorasync("train --config " + testing::shell_quote(run.config.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err.substr(r.err.size() > 20000 ? r.err.size() - 20000 : 0);
  const auto last = testing::read_jsonl(run.out / "metrics.jsonl").back();
  EXPECT_EQ(last["step"], 12);
  EXPECT_GE(last["sync_index"].get<int>(), 5) << last.dump();
  EXPECT_GE(last["rollout/cancelled_stale_total"].get<int>(), 3) << last.dump();
  // Requests of versions leaving the window were in flight at their switches, and were cancelled.
  EXPECT_GE(fake.cancelled_while_held(), 3);
  EXPECT_EQ(fake.slot_refusals(), 0) << "a load found every slot taken";
  EXPECT_EQ(fake.most_loaded(), 3);
}

// Answers requests for the first version as DeterministicServer does and refuses every request
// for a later version with a permanent 400. The load of version 2 (the sync after step 1) is held
// 1 s, so step 2's groups (version 1, dispatched during step 1) are assembled before the switch;
// the load of version 3 (the sync after step 2, the last) is held 2 s, so the refusals of the
// version-2 requests reach the trainer after its last step and before it stops the pipeline.
class LateRefusalServer : public DeterministicServer {
 public:
  LateRefusalServer() = default;
  ~LateRefusalServer() override { stop(); }
  std::set<int> refused() const {
    std::lock_guard lk(refused_mu_);
    return refused_;
  }

 private:
  http::Response completions(const json& body, const std::string& model, const std::string& sha) override {
    if (model == "policy-v1") return DeterministicServer::completions(body, model, sha);
    std::lock_guard lk(refused_mu_);
    refused_.insert(problem_of(body));
    return http::json_response(400, R"x({"error":{"message":"max_tokens is too large for this deployment (scripted)"}})x");
  }
  double load_hold_s(const std::string& name) override { return name == "policy-v2" ? 1.0 : name == "policy-v3" ? 2.0 : 0.0; }
  mutable std::mutex refused_mu_;
  std::set<int> refused_;
};

// A fatal refusal that lands after the last step's groups were assembled ends a run that trained
// every step: the final checkpoint and adapter are written, the refused prompts are owed by that
// checkpoint, and the exit status is still 1 with the server's message (trainer.md §1).
TEST(TrainFaults, AFatalRefusalAfterTheLastStepStillExitsOneAndIsOwed) {
  LateRefusalServer fake;
  TrainRun run(fake.port(), 2);
  testing::patch_file(run.config, "weight_sync_steps = 2", "weight_sync_steps = 1");
  auto r = testing::run_lorasync("train --config " + testing::shell_quote(run.config.string()));
  const std::string tail = r.err.substr(r.err.size() > 20000 ? r.err.size() - 20000 : 0);
  EXPECT_EQ(r.exit_code, 1) << tail;
  EXPECT_NE(r.err.find("error after the last step"), std::string::npos) << tail;
  EXPECT_NE(r.err.find("too large for this deployment"), std::string::npos) << tail;
  EXPECT_EQ(testing::read_jsonl(run.out / "metrics.jsonl").size(), 2u) << tail;
  EXPECT_EQ(read_file(run.out / "checkpoints" / "latest"), "step-000002\n");
  EXPECT_TRUE(fs::exists(run.out / "final_adapter" / "adapter_config.json"));
  const std::set<int> refused = fake.refused();
  ASSERT_FALSE(refused.empty()) << "no request for version 2 was refused: the run did not get where the test looks";
  const json state = json::parse(read_file(run.out / "checkpoints" / "step-000002" / "state.json"));
  std::set<int> owed;
  for (const auto& p : state.at("cursor").at("redo")) owed.insert(p.at(0).get<int>());
  for (int n : refused) EXPECT_TRUE(owed.count(n)) << "refused prompt " << n << " is not owed: " << state.at("cursor").dump();
}

// A row that cannot fit in memory is refused at start (exit 2), with the numbers to change.
TEST(TrainFaults, ARowThatCannotFitInMemoryIsRefusedAtStart) {
  DeterministicServer fake;
  TrainRun run(fake.port(), 2);
  auto r = testing::run_lorasync("train --config " + testing::shell_quote(run.config.string()) +
                                 " --set batching.row_tokens=2000000000");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("batching.row_tokens = 2000000000 needs about"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("GiB are available on cpu: lower batching.row_tokens to"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("or set batching.activation_checkpointing = true"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(run.out / "checkpoints")) << "refused before anything ran";
}

}  // namespace
}  // namespace lorasync
