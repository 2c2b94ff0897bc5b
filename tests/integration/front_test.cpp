// The two executables (apps/lorasync/CMakeLists.txt): `lorasync`, the front, runs the commands
// that need no libtorch in its own process and execs lorasync-engine for the others.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "front.h"
#include "util/child_process.h"
#include "util/jsonl.h"
#include "util/run_command.h"

namespace lorasync::testing {
namespace {

bool front_runs(std::vector<std::string> args) {
  args.insert(args.begin(), "lorasync");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return front::runs_here(static_cast<int>(args.size()), argv.data());
}

TEST(Front, PicksTheCommandsThatNeedNoLibtorch) {
  EXPECT_TRUE(front_runs({"proxy", "--listen", "127.0.0.1:0"}));
  EXPECT_TRUE(front_runs({"--log-level", "warn", "proxy"}));
  EXPECT_TRUE(front_runs({"--log-level=debug", "grade"}));
  EXPECT_TRUE(front_runs({"tokenize", "--help"}));
  EXPECT_TRUE(front_runs({"train-tokenizer"}));
  EXPECT_TRUE(front_runs({"report", "runs/x"}));
  EXPECT_TRUE(front_runs({"stub-replica"}));
  EXPECT_TRUE(front_runs({"bench", "proxy", "--concurrency", "32"}));
  EXPECT_TRUE(front_runs({"bench", "grade"}));
  EXPECT_TRUE(front_runs({"bench", "tokenizer"}));
  EXPECT_TRUE(front_runs({"bench", "startup"}));
  EXPECT_TRUE(front_runs({"--version"}));

  EXPECT_FALSE(front_runs({"serve", "--model", "proxy"}));  // a later word does not count
  EXPECT_FALSE(front_runs({"train"}));
  EXPECT_FALSE(front_runs({"demo"}));
  EXPECT_FALSE(front_runs({"--log-level", "proxy", "train"}));  // "proxy" is the option's value
  EXPECT_FALSE(front_runs({"bench", "sync"}));
  EXPECT_FALSE(front_runs({"bench", "train"}));
  EXPECT_FALSE(front_runs({"bench"}));
  EXPECT_FALSE(front_runs({"bench", "--help"}));
  EXPECT_FALSE(front_runs({}));              // the engine says a command is required, listing all
  EXPECT_FALSE(front_runs({"--help"}));      // the engine's help lists every command
  EXPECT_FALSE(front_runs({"--version", "--help"}));
  EXPECT_FALSE(front_runs({"no-such-command"}));  // the engine names it unknown
  EXPECT_FALSE(front_runs({"--log-level"}));       // the engine says the option lacks its value
  EXPECT_FALSE(front_runs({"-h", "grade"}));       // help before the command: the engine's (the same)
  EXPECT_FALSE(front_runs({"bench", "--help", "proxy"}));  // the engine's bench help lists every bench
  EXPECT_TRUE(front_runs({"grade", "--help"}));    // the command's own help
  EXPECT_TRUE(front_runs({"bench", "proxy", "--help"}));
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(Front, TheProxyRunsWithoutLibtorch) {
  ChildProcess p({LORASYNC_BINARY, "--log-level", "warn", "proxy", "--listen", "127.0.0.1:0", "--upstream",
                  "http://127.0.0.1:9", "--upstream-token-env", "", "--reconcile-interval", "0",
                  "--stats-log-interval", "0"});
  auto line = p.read_line(30);
  ASSERT_TRUE(line.has_value()) << "the proxy did not start";
  ASSERT_NE(line->find("listening"), std::string::npos) << *line;
  const std::string proc = "/proc/" + std::to_string(p.pid());
  const std::string maps = read_text(proc + "/maps");
  ASSERT_FALSE(maps.empty());
  EXPECT_EQ(maps.find("libtorch"), std::string::npos);
  EXPECT_EQ(maps.find("libc10"), std::string::npos);
  EXPECT_EQ(maps.find("lorasync-engine"), std::string::npos);
  // The same process: no exec happened (its image is the front).
  std::error_code ec;
  EXPECT_EQ(fs::read_symlink(proc + "/exe", ec).filename().string(), "lorasync");
}

TEST(Front, EngineCommandsRunInTheEngineWithTheirArgumentsIntact) {
  auto r = run_lorasync("serve --help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("--max-num-seqs"), std::string::npos) << r.out;
  // An error of the engine's own parsing, with the argument passed through.
  r = run_lorasync("--log-level warn train --no-such-flag-xyz");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE((r.out + r.err).find("no-such-flag-xyz"), std::string::npos) << r.out << r.err;
  // Help lists every command, the engine's and the front's.
  r = run_lorasync("--help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const char* c : {"serve", "train", "demo", "proxy", "grade", "bench"})
    EXPECT_NE(r.out.find(std::string("  ") + c + " "), std::string::npos) << c << "\n" << r.out;
}

TEST(Front, AFrontStartedAsTheEngineStopsInsteadOfLooping) {
  // LORASYNC_ENGINE naming the front itself: the front exec'd as the engine finds its own marker.
  const std::string env = "LORASYNC_ENGINE=" + shell_quote(LORASYNC_BINARY) + " ";
  auto r = run_command(env + "timeout 20 " + shell_quote(LORASYNC_BINARY) + " train --help");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("must be the engine"), std::string::npos) << r.err;
}

TEST(Front, AMissingEngineIsNamedAndFrontCommandsStillRun) {
  TempDir tmp("lorasync-front");
  const std::string missing = (tmp.path() / "no-engine").string();
  const std::string env = "LORASYNC_ENGINE=" + shell_quote(missing) + " ";
  auto r = run_command(env + shell_quote(LORASYNC_BINARY) + " train --help");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("lorasync-engine"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(missing), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("No such file"), std::string::npos) << r.err;
  // The front's own commands need no engine.
  r = run_command(env + shell_quote(LORASYNC_BINARY) + " --version");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("lorasync "), std::string::npos);
  r = run_command(env + shell_quote(LORASYNC_BINARY) + " grade", R"({"completion": "\\boxed{4}", "answer": "4"})" "\n");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("true"), std::string::npos) << r.out;
}

// `bench startup` (the README's "MiB resident, ms to start"): the same proxy command started from
// the front and from the engine, each row the front's statistic against the engine's same
// statistic. Which is smaller is the bench's to say, not a test's; that the engine, with libtorch
// mapped, is resident in more memory than the front is a property of the build, checked here.
TEST(Front, BenchStartupComparesTheFrontWithTheEngineOnTheSameStatistic) {
  auto r = run_lorasync("bench startup --starts 2 --settle-ms 50");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::map<std::string, nlohmann::json> rows;
  for (const auto& rec : parse_jsonl(r.out)) rows[rec["metric"].get<std::string>()] = rec;
  for (const char* m : {"start_ms", "rss_mib", "start_cpu_ms"}) {
    for (const char* stat : {"median", "best"}) {
      const std::string name = std::string(m) + "_" + stat;
      ASSERT_TRUE(rows.count(name)) << name << "\n" << r.out;
      const auto& rec = rows[name];
      EXPECT_EQ(rec["bench"], "startup");
      EXPECT_EQ(rec["config"]["statistic"], stat);
      EXPECT_EQ(rec["config"]["starts"], 2);
      EXPECT_GE(rec["value"].get<double>(), 0) << rec.dump();
      EXPECT_GT(rec["baseline"].get<double>(), 0) << rec.dump();
    }
  }
  EXPECT_GT(rows["rss_mib_median"]["value"].get<double>(), 0);
  EXPECT_LT(rows["rss_mib_median"]["value"].get<double>(), rows["rss_mib_median"]["baseline"].get<double>());
}

}  // namespace
}  // namespace lorasync::testing
