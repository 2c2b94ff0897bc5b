// `lorasync demo` end to end with a shortened schedule (few SFT steps, 40 GRPO steps, a small
// held-out set): every child process starts and talks over the real protocols, Ctrl-C (SIGINT)
// stops the trainer with a checkpoint (exit 130), `--resume` continues the same run to the end,
// and the summary, eval results and report are written. The quality bar of the full demo is
// checked by running it (README); this test checks the wiring and the resume.
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

TEST(Demo, InterruptedRunResumesAndWritesTheReport) {
  TempDir dir("lorasync-demo-it");
  const fs::path run = dir.path() / "run", cache = dir.path() / "cache";
  const std::vector<std::string> common = {"--run-dir", run.string(), "--cache-dir", cache.string(), "--steps", "40",
                                           "--eval-problems", "16", "--eval-samples", "1", "--model-steps", "40"};
  {
    std::vector<std::string> argv = {LORASYNC_BINARY, "demo"};
    argv.insert(argv.end(), common.begin(), common.end());
    testing::ChildProcess demo(argv);
    // Interrupt after step 6 (a checkpoint exists from step 5).
    for (int i = 0; i < 6000; ++i) {
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
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto metrics = read_jsonl(run / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 40u);
  for (std::size_t i = 0; i < metrics.size(); ++i) EXPECT_EQ(metrics[i]["step"], static_cast<int>(i) + 1);
  EXPECT_EQ(metrics.back()["restarts"], 1);
  EXPECT_EQ(metrics.back()["rollout/failed_total"], 0);
  for (const char* f : {"summary.json", "eval.json", "eval-base.json", "eval-trained.json", "report.html", "plots/reward.svg",
                        "final_adapter/adapter_model.safetensors"})
    EXPECT_TRUE(fs::exists(run / f)) << f;
  auto ev = json::parse(read_file(run / "eval.json"));
  EXPECT_GE(ev["trained"]["accuracy"].get<double>(), 0.0);
  EXPECT_LE(ev["trained"]["accuracy"].get<double>(), 1.0);
  const std::string html = read_file(run / "report.html");
  EXPECT_NE(html.find("<svg"), std::string::npos);
  auto last = json::parse(r.out.substr(r.out.rfind('{')));
  EXPECT_EQ(last["event"], "demo_finished");
}

}  // namespace
}  // namespace lorasync
