// `lorasync demo` end to end, as the README runs it: the default base model (1,200 SFT steps, the
// demo's own, made once here and cached for the second part) and the default GRPO schedule (160
// steps, 200 held-out problems x 2 samples, seed 1). Every child process starts and talks over the
// real protocols; Ctrl-C (SIGINT) stops the trainer with a checkpoint (exit 130) and `--resume`
// continues the same run to the end; GRPO itself must then meet the demo's quality bar (held-out
// accuracy +0.25 over the base model, mean reward of the last 10 steps +0.2 over the first 10, no
// failed request, every version on both replicas: exit 0). This seed and budget met it with wide
// margins (0.328 -> 0.787 accuracy, +0.54 reward), so a miss is a regression, not bad luck.
// Second part, on the same cached model: a run whose adapter never trains (learning rate 0: the
// adapter stays the identity, so it grades like the base model) fails the bar with exit 3 and
// names what it missed.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <signal.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "util/child_process.h"
#include "util/files.h"
#include "util/jsonl.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using nlohmann::json;

using testing::read_jsonl;

TEST(Demo, LearnsAcrossAnInterruptionAndAnUntrainedAdapterFailsTheBar) {
  TempDir dir("lorasync-demo-it");
  const fs::path run = dir.path() / "run", cache = dir.path() / "cache";
  const std::vector<std::string> common = {"--run-dir", run.string(), "--cache-dir", cache.string()};
  {
    std::vector<std::string> argv = {LORASYNC_BINARY, "demo"};
    argv.insert(argv.end(), common.begin(), common.end());
    testing::ChildProcess demo(argv);
    // Interrupt after step 6 (a checkpoint exists from step 5). The bound only turns a hang into a
    // failure: the base model is made first.
    for (int i = 0; i < 18000; ++i) {
      if (fs::exists(run / "metrics.jsonl") && read_jsonl(run / "metrics.jsonl").size() >= 6) break;
      if (auto code = demo.wait_exit(0.1)) FAIL() << "demo exited early with " << *code << ": " << demo.stderr_text();
    }
    demo.kill(SIGINT);
    auto code = demo.wait_exit(120);
    ASSERT_TRUE(code.has_value());
    EXPECT_EQ(*code, 130) << demo.stderr_text();
  }
  ASSERT_TRUE(fs::exists(run / "checkpoints" / "latest"));
  std::string args;
  for (const auto& a : common) args += " " + testing::shell_quote(a);
  auto r = testing::run_lorasync("demo --resume" + args);
  auto metrics = read_jsonl(run / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 160u) << r.err;
  for (std::size_t i = 0; i < metrics.size(); ++i) EXPECT_EQ(metrics[i]["step"], static_cast<int>(i) + 1);
  EXPECT_EQ(metrics.back()["restarts"], 1);
  EXPECT_EQ(metrics.back()["rollout/failed_total"], 0);
  for (const char* f : {"summary.json", "eval.json", "eval-base.json", "eval-trained.json", "report.html", "plots/reward.svg",
                        "final_adapter/adapter_model.safetensors"})
    EXPECT_TRUE(fs::exists(run / f)) << f;
  const std::string html = read_file(run / "report.html");
  EXPECT_NE(html.find("<svg"), std::string::npos);
  auto last = json::parse(r.out.substr(r.out.rfind('{')));
  EXPECT_EQ(last["event"], "demo_finished");
  // GRPO learned: the quality bar is met, so the demo exits 0.
  EXPECT_TRUE(last["ok"].get<bool>()) << last.dump(1) << "\n" << r.err;
  EXPECT_TRUE(last["failures"].empty()) << last.dump(1);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_GE(last["accuracy_trained"].get<double>() - last["accuracy_base"].get<double>(), 0.25) << last.dump(1);
  EXPECT_GE(last["reward_last10"].get<double>() - last["reward_first10"].get<double>(), 0.2) << last.dump(1);

  // The same base model (cached), an adapter that never trains: lr 0, AdamW never moves it from its
  // initialisation (B = 0, the identity), so the "trained" adapter grades like the base model.
  const fs::path run0 = dir.path() / "run-untrained";
  auto u = testing::run_lorasync("demo --run-dir " + testing::shell_quote(run0.string()) + " --cache-dir " +
                                 testing::shell_quote(cache.string()) + " --steps 20 --lr 0 --eval-problems 32 --eval-samples 1");
  EXPECT_EQ(u.exit_code, 3) << u.err;
  EXPECT_NE(u.err.find("the run did not learn"), std::string::npos) << u.err;
  EXPECT_NE(u.err.find("held-out accuracy rose by"), std::string::npos) << u.err;
  auto lastu = json::parse(u.out.substr(u.out.rfind('{')));
  EXPECT_EQ(lastu["event"], "demo_finished");
  EXPECT_FALSE(lastu["ok"].get<bool>());
  EXPECT_FALSE(lastu["failures"].empty());
  // (Equal up to batching: the two evals may group requests differently.)
  EXPECT_LT(lastu["accuracy_trained"].get<double>() - lastu["accuracy_base"].get<double>(), 0.25);
}

}  // namespace
}  // namespace lorasync
