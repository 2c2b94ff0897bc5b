// Data-parallel ranks of `lorasync train` (docs/trainer.md "Data-parallel ranks") on CPU with Gloo, against a
// deterministic fake server with async.ordered (the same groups in the same order every run):
// 2 ranks train the same adapter as 1 rank within 1e-5; a rank killed mid-run stops the run with
// an error naming it and a checkpoint, which resumes on 1 rank with no group replayed or skipped;
// a rank count the step cannot feed is refused at start.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include "core/io/safetensors.h"
#include "train_fakes.h"
#include "util/child_process.h"
#include "util/jsonl.h"
#include "util/strings.h"

namespace lorasync {
namespace {

using nlohmann::json;
using testing::DeterministicServer;
using testing::TrainRun;

// async.ordered with room for a whole step in flight (the groups of each step are fixed).
void make_ordered(const TrainRun& run) {
  testing::patch_file(run.config, "max_inflight = 8\nqueue_maxsize = 32\nscore_workers = 1\n",
                      "ordered = true\nmax_inflight = 64\nqueue_maxsize = 64\nscore_workers = 3\n");
}

// The largest absolute difference between two adapters' tensors (every tensor present in both).
double max_adapter_diff(const fs::path& a, const fs::path& b) {
  io::SafetensorsFile fa(a / "adapter_model.safetensors"), fb(b / "adapter_model.safetensors");
  EXPECT_EQ(fa.tensors().size(), fb.tensors().size());
  double worst = 0;
  for (const auto& t : fa.tensors()) {
    const auto& u = fb.get(t.name);
    EXPECT_EQ(t.dtype, io::DType::kF32) << t.name;
    EXPECT_EQ(t.shape, u.shape) << t.name;
    const auto* x = reinterpret_cast<const float*>(t.data);
    const auto* y = reinterpret_cast<const float*>(u.data);
    for (std::int64_t i = 0; i < t.numel(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(x[i] - y[i])));
  }
  return worst;
}

std::vector<std::pair<int, int>> trained_groups(const fs::path& out) {
  std::vector<std::pair<int, int>> g;
  for (const auto& e : testing::read_jsonl(out / "groups.jsonl"))
    if (e["disposition"] == "trained") g.emplace_back(e["epoch"].get<int>(), e["prompt"].get<int>());
  return g;
}

// The pid of `rank`, from the launcher's start line ("... rank 1 pid 1234 ...").
pid_t rank_pid(const std::string& launcher_stderr, int rank) {
  std::smatch m;
  const std::regex re("rank " + std::to_string(rank) + " pid ([0-9]+)");
  return std::regex_search(launcher_stderr, m, re) ? static_cast<pid_t>(std::stol(m[1])) : 0;
}

std::string with_env(const std::string& env, const std::string& args) { return env + " " + std::string(LORASYNC_BINARY) + " " + args; }

TEST(TrainDataParallel, TwoRanksTrainTheSameAdapterAsOne) {
  DeterministicServer fa, fb;
  TrainRun one(fa.port(), 6), two(fb.port(), 6);
  make_ordered(one);
  make_ordered(two);
  auto r1 = testing::run_lorasync("train --config " + testing::shell_quote(one.config.string()));
  ASSERT_EQ(r1.exit_code, 0) << r1.err;
  auto r2 = testing::run_lorasync("train --nproc-per-node 2 --config " + testing::shell_quote(two.config.string()));
  ASSERT_EQ(r2.exit_code, 0) << r2.err;
  EXPECT_NE(r2.err.find("started 2 data-parallel ranks"), std::string::npos) << r2.err;

  const double diff = max_adapter_diff(one.out / "final_adapter", two.out / "final_adapter");
  std::printf("figure: 2 ranks vs 1, final adapter max |diff| = %.3g\n", diff);
  EXPECT_LE(diff, 1e-5);
  EXPECT_EQ(trained_groups(one.out), trained_groups(two.out));
  auto m1 = testing::read_jsonl(one.out / "metrics.jsonl"), m2 = testing::read_jsonl(two.out / "metrics.jsonl");
  ASSERT_EQ(m1.size(), 6u);
  ASSERT_EQ(m2.size(), 6u);
  bool learned = false;
  for (std::size_t i = 0; i < 6; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_FALSE(m1[i].contains("dp/ranks"));
    EXPECT_EQ(m2[i]["dp/ranks"], 2);
    // Both ranks computed: each packed its own row (one row holds the whole step on one rank).
    EXPECT_EQ(m1[i]["batch/microbatches_per_step"], 1);
    EXPECT_EQ(m2[i]["batch/microbatches_per_step"], 2);
    for (const char* k : {"loss", "grad_norm", "entropy", "ratio", "ratio/min", "ratio/max", "reward", "learning_rate"})
      EXPECT_NEAR(m1[i][k].get<double>(), m2[i][k].get<double>(), 1e-5 * (1 + std::fabs(m1[i][k].get<double>()))) << k;
    learned = learned || m1[i]["grad_norm"].get<double>() > 0;
  }
  EXPECT_TRUE(learned) << "the rewards must vary within groups, or the test compares zeros";
}

TEST(TrainDataParallel, AKilledRankLeavesACheckpointThatResumesOnOneRankWithoutReplayOrSkip) {
  constexpr int kSteps = 30;  // long enough that the run cannot end before the kill lands
  DeterministicServer fa, fb;
  TrainRun ref(fa.port(), kSteps), run(fb.port(), kSteps);
  make_ordered(ref);
  make_ordered(run);
  auto r = testing::run_lorasync("train --config " + testing::shell_quote(ref.config.string()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  {
    testing::ChildProcess train({LORASYNC_BINARY, "train", "--nproc-per-node", "2", "--config", run.config.string()},
                                {"LORASYNC_DIST_SILENT_S=3"});
    const fs::path metrics = run.out / "metrics.jsonl";
    // Complete lines only: the trainer may be writing the next one.
    auto steps = [&] {
      const std::string text = fs::exists(metrics) ? read_file(metrics) : std::string();
      return static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
    };
    for (int i = 0; i < 1200 && steps() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_GE(steps(), 3u) << train.stderr_text();
    const pid_t rank1 = rank_pid(train.stderr_text(), 1);
    ASSERT_GT(rank1, 0) << train.stderr_text();
    ::kill(rank1, SIGKILL);
    auto code = train.wait_exit(120);
    ASSERT_TRUE(code.has_value()) << train.stderr_text();
    EXPECT_EQ(*code, 1) << train.stderr_text();
    const std::string err = train.stderr_text();
    EXPECT_NE(err.find("rank 1 (pid " + std::to_string(rank1) + ") was killed by signal 9"), std::string::npos) << err;
    EXPECT_NE(err.find("rank 1 stopped answering"), std::string::npos) << err;
    ASSERT_TRUE(fs::exists(run.out / "checkpoints" / "latest")) << err;
    EXPECT_LT(steps(), static_cast<std::size_t>(kSteps)) << "the kill came after the run ended";
  }
  // The checkpoint resumes on one rank: every step once, the same groups as the reference run.
  auto resumed = testing::run_lorasync("train --resume --config " + testing::shell_quote(run.config.string()));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  auto metrics = testing::read_jsonl(run.out / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), static_cast<std::size_t>(kSteps));
  for (std::size_t i = 0; i < metrics.size(); ++i) EXPECT_EQ(metrics[i]["step"], static_cast<int>(i) + 1);
  EXPECT_EQ(metrics.back()["restarts"], 1);
  const auto want = trained_groups(ref.out), got = trained_groups(run.out);
  EXPECT_EQ(got, want) << "a group replayed, skipped or reordered";
  const double diff = max_adapter_diff(ref.out / "final_adapter", run.out / "final_adapter");
  std::printf("figure: killed at 2 ranks, resumed on 1, vs 1 rank throughout: max |diff| = %.3g\n", diff);
  EXPECT_LE(diff, 1e-5);
}

// A rank whose share of a step fails (the test hook LORASYNC_FAULT_STEP) stops the run: every
// rank leaves the step's collectives, none steps, rank 0 reports that rank's error, checkpoints
// the last complete step and tells the others to go; the run then resumes.
TEST(TrainDataParallel, AFailedShareOnAnyRankStopsTheRunWithThatError) {
  DeterministicServer fake;
  TrainRun run(fake.port(), 6);
  make_ordered(run);
  const std::string args = "train --nproc-per-node 2 --config " + testing::shell_quote(run.config.string());
  auto r = testing::run_command(with_env("LORASYNC_FAULT_STEP=1:3", args));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("data-parallel rank 1 failed in step 3: injected fault"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1: rank 0 stopped the run"), std::string::npos) << r.err;
  EXPECT_EQ(testing::read_jsonl(run.out / "metrics.jsonl").size(), 2u);
  EXPECT_EQ(read_file(run.out / "checkpoints" / "latest"), "step-000002\n");
  // Rank 0's own share failing releases the others at once (they are inside the collectives).
  const auto t0 = std::chrono::steady_clock::now();
  auto r0 = testing::run_command(with_env("LORASYNC_FAULT_STEP=0:4", "train --resume --nproc-per-node 2 --config " +
                                                                       testing::shell_quote(run.config.string())));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r0.exit_code, 1) << r0.err;
  EXPECT_NE(r0.err.find("injected fault (LORASYNC_FAULT_STEP=0:4) in rank 0's share of step 4"), std::string::npos) << r0.err;
  EXPECT_NE(r0.err.find("rank 1: rank 0 stopped the run: injected fault"), std::string::npos) << r0.err;
  EXPECT_LT(took, 60.0) << "the ranks waited on each other";
  EXPECT_EQ(read_file(run.out / "checkpoints" / "latest"), "step-000003\n");
  auto done = testing::run_lorasync("train --resume --nproc-per-node 2 --config " + testing::shell_quote(run.config.string()));
  ASSERT_EQ(done.exit_code, 0) << done.err;
  auto metrics = testing::read_jsonl(run.out / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 6u);
  std::set<std::pair<int, int>> seen;
  for (const auto& g : trained_groups(run.out)) EXPECT_TRUE(seen.insert(g).second) << "trained twice";
}

TEST(TrainDataParallel, MoreRanksThanSamplesPerStepIsRefusedAtStart) {
  DeterministicServer fake;
  TrainRun run(fake.port(), 2);
  auto r = testing::run_lorasync("train --nproc-per-node 3 --config " + testing::shell_quote(run.config.string()) +
                                 " --set batching.samples_per_step=2 --set grpo.num_generations=2");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("batching.samples_per_step = 2 is smaller than the 3 data-parallel ranks"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1: rank 0 stopped the run"), std::string::npos) << r.err;
  // Launcher variables that do not make sense are named.
  auto bad = testing::run_command(std::string("WORLD_SIZE=2 RANK=5 MASTER_PORT=1 ") + LORASYNC_BINARY + " train --config " +
                                  testing::shell_quote(run.config.string()));
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("RANK=5"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace lorasync
