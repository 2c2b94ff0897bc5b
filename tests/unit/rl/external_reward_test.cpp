// External rewards (rl/external_reward.h): sandboxed command workers and HTTP reward servers,
// with a hard deadline per call. Workers are small Python scripts written to a temp dir (Debian's
// python3); the HTTP peer is a raw-socket server thread. Each misbehaviour (a hang, a crash,
// garbage, an out-of-range value, an endless line) fails only its own call, with the documented
// kind and within the deadline, and the next call works.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <set>
#include <thread>

#include "rl/config.h"
#include "rl/external_reward.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync {
namespace {

using reward::RewardCallFailed;
using reward::RewardFailure;
using reward::RewardInput;

struct Scripts {
  TempDir dir{"lorasync-ext-reward"};
  fs::path write(const std::string& name, const std::string& body) {
    fs::path p = dir.path() / name;
    std::ofstream(p) << body;
    return p;
  }
};

// Behaviour chosen by the completion text.
const char* kMisbehaving = R"PY(
import json, os, sys, time
for line in sys.stdin:
    c = json.loads(line)["completion"]
    if c == "hang": time.sleep(3600)
    if c == "crash": os._exit(3)
    if c == "garbage": print("this is not json", flush=True); continue
    if c == "range": print(json.dumps({"reward": 7}), flush=True); continue
    if c == "endless": sys.stdout.write("x" * 3000000); sys.stdout.flush(); time.sleep(3600)
    open(os.path.join(os.environ.get("PIDS", "/nonexistent"), str(os.getpid())), "w").close() if "PIDS" in os.environ else None
    print(json.dumps({"reward": min(1.0, len(c) / 100)}), flush=True)
)PY";

rl::ExternalRewardOptions command_options(const fs::path& script, double timeout_s = 0.5, std::int64_t workers = 2) {
  rl::ExternalRewardOptions o;
  o.name = "test";
  o.kind = "command";
  o.command = {"python3", script.string()};
  o.workers = workers;
  o.timeout_s = timeout_s;
  o.memory_mb = 1024;
  o.max_output_bytes = 1 << 20;
  return o;
}

RewardInput input(const std::string& completion, std::vector<std::string> refs = {"42"}) {
  RewardInput in;
  in.prompt = "p";
  in.completion = completion;
  in.finish_reason = "stop";
  in.references = std::move(refs);
  return in;
}

// Expects the call to fail with `kind` (and `needle` in its message). No bound on its time: the
// scripts' hangs last an hour, so a deadline that did not fire shows as the test's timeout, and
// the failure's kind and message say which deadline or check ended the call.
void expect_failure(const reward::RewardFunction& fn, const RewardInput& in, RewardFailure kind, const std::string& needle = "") {
  try {
    fn.score(in);
    ADD_FAILURE() << "no failure for '" << in.completion << "'";
  } catch (const RewardCallFailed& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    if (!needle.empty()) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}

TEST(ExternalReward, CommandWorkersAnswerConcurrentCallsWithinThePool) {
  Scripts s;
  auto script = s.write("ok.py", kMisbehaving);
  fs::create_directories(s.dir.path() / "pids");
  auto o = command_options(script, 10, 2);
  setenv("PIDS", (s.dir.path() / "pids").c_str(), 1);  // read by the workers, started on first use
  auto fn = rl::make_external_reward(o);
  EXPECT_TRUE(fn->parallel_members());
  std::atomic<int> wrong{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 6; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) {
        std::string c(static_cast<std::size_t>(10 * t + i), 'a');
        if (fn->score(input(c)).reward != std::min(1.0, static_cast<double>(c.size()) / 100)) ++wrong;
      }
    });
  for (auto& t : ts) t.join();
  unsetenv("PIDS");
  EXPECT_EQ(wrong.load(), 0);
  std::size_t workers = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(s.dir.path() / "pids")) ++workers;
  EXPECT_GE(workers, 1u);
  EXPECT_LE(workers, 2u);  // two long-lived workers served all 30 calls
}

TEST(ExternalReward, AHangACrashAndGarbageFailOnlyTheirOwnCall) {
  Scripts s;
  auto fn = rl::make_external_reward(command_options(s.write("w.py", kMisbehaving), 1.0, 1));
  EXPECT_DOUBLE_EQ(fn->score(input("abcd")).reward, 0.04);  // starts the worker (within startup_s)
  expect_failure(*fn, input("hang"), RewardFailure::kTimeout, "within 1 s");
  EXPECT_DOUBLE_EQ(fn->score(input("ab")).reward, 0.02);  // a new worker took the killed one's place
  expect_failure(*fn, input("crash"), RewardFailure::kCrashed, "exited with status 3");
  EXPECT_DOUBLE_EQ(fn->score(input("abc")).reward, 0.03);
  expect_failure(*fn, input("garbage"), RewardFailure::kInvalidOutput, "not JSON");
  expect_failure(*fn, input("range"), RewardFailure::kInvalidOutput, "[0, 1]");
  expect_failure(*fn, input("endless"), RewardFailure::kInvalidOutput, "without a newline");
  EXPECT_DOUBLE_EQ(fn->score(input("abcde")).reward, 0.05);
}

TEST(ExternalReward, TheSandboxHasNoNetworkAndAMemoryLimit) {
  if (!rl::network_isolation_available())
    GTEST_SKIP() << "this kernel refuses unshare(CLONE_NEWNET) even in a user namespace: commands run with rlimits only";
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(ls, 8), 0);
  socklen_t len = sizeof a;
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  Scripts s;
  auto script = s.write("probe.py", R"PY(
import json, socket, sys
for line in sys.stdin:
    what = json.loads(line)["completion"]
    ok = 0.0
    if what.startswith("connect:"):
        try:
            socket.create_connection(("127.0.0.1", int(what[8:])), timeout=1).close(); ok = 1.0
        except OSError: pass
    elif what == "alloc":
        try:
            b = bytearray(512 << 20); ok = 1.0
        except MemoryError: pass
    print(json.dumps({"reward": ok}), flush=True)
)PY");
  auto isolated = command_options(script, 5, 1);
  isolated.memory_mb = 256;
  auto fn = rl::make_external_reward(isolated);
  EXPECT_EQ(fn->score(input("connect:" + std::to_string(port))).reward, 0.0);  // no route out of its namespace
  EXPECT_EQ(fn->score(input("alloc")).reward, 0.0);                            // 512 MiB > RLIMIT_AS 256 MiB
  auto open = command_options(script, 5, 1);
  open.network = true;
  open.memory_mb = 2048;
  auto fn2 = rl::make_external_reward(open);
  EXPECT_EQ(fn2->score(input("connect:" + std::to_string(port))).reward, 1.0);  // the control: reachable
  EXPECT_EQ(fn2->score(input("alloc")).reward, 1.0);
  close(ls);
}

TEST(ExternalReward, ShutdownFailsRunningAndWaitingCallsAtOnce) {
  Scripts s;
  auto fn = rl::make_external_reward(command_options(s.write("w.py", kMisbehaving), 60, 1));
  std::atomic<int> unavailable{0};
  auto call = [&](const std::string& c) {
    try {
      fn->score(input(c));
    } catch (const RewardCallFailed& e) {
      if (e.kind() == RewardFailure::kUnavailable) ++unavailable;
    }
  };
  std::thread running(call, "hang");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::thread waiting(call, "ok");  // no free worker: waits
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  fn->shutdown();
  running.join();
  waiting.join();
  EXPECT_EQ(unavailable.load(), 2);  // both ended by the shutdown, not by the deadline (kTimeout)
  expect_failure(*fn, input("ok"), RewardFailure::kUnavailable, "shutting down");
}

TEST(ExternalReward, ConfigurationErrorsNameTheOption) {
  rl::ExternalRewardOptions o;
  o.name = "r";
  o.kind = "command";
  try {
    rl::make_external_reward(o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rewards.r.command"), std::string::npos) << e.what();
  }
  o.kind = "ftp";
  o.command = {"true"};
  EXPECT_THROW(rl::make_external_reward(o), Error);
  o.kind = "http";
  o.url = "not a url";
  EXPECT_THROW(rl::make_external_reward(o), Error);
  o.kind = "command";
  o.command = {"/nonexistent/reward-program"};
  auto fn = rl::make_external_reward(o);
  expect_failure(*fn, input("x"), RewardFailure::kUnavailable, "cannot start '/nonexistent/reward-program'");
}

// A one-connection-at-a-time HTTP server answering by the request body.
class TinyHttp {
 public:
  TinyHttp() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    listen(fd_, 16);
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { loop(); });
  }
  ~TinyHttp() {
    stop_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
    for (auto& t : hung_) t.join();
  }
  int port() const { return port_; }

 private:
  void loop() {
    while (!stop_) {
      int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      std::string req;
      char buf[4096];
      for (;;) {
        auto he = req.find("\r\n\r\n");
        if (he != std::string::npos) {
          auto cl = req.find("Content-Length: ");
          if (cl == std::string::npos) cl = req.find("content-length: ");
          std::size_t n = cl == std::string::npos ? 0 : std::stoul(req.substr(cl + 16));
          if (req.size() >= he + 4 + n) break;
        }
        ssize_t r = recv(c, buf, sizeof buf, 0);
        if (r <= 0) break;
        req.append(buf, static_cast<std::size_t>(r));
      }
      std::string status = "200 OK", body = R"({"reward": 0.25})";
      if (req.find("\"completion\":\"hang\"") != std::string::npos) {
        hung_.emplace_back([c, this] {  // never answers; closes when the test ends
          while (!stop_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          close(c);
        });
        continue;
      }
      if (req.find("\"completion\":\"garbage\"") != std::string::npos) body = "<html>no</html>";
      if (req.find("\"completion\":\"error\"") != std::string::npos) status = "500 Internal Server Error";
      std::string resp = "HTTP/1.1 " + status + "\r\nContent-Type: application/json\r\nContent-Length: " +
                         std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
      send(c, resp.data(), resp.size(), MSG_NOSIGNAL);
      close(c);
    }
  }
  int fd_ = -1, port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::vector<std::thread> hung_;
};

TEST(ExternalReward, HttpRewardAnswersTimesOutAndFails) {
  TinyHttp server;
  rl::ExternalRewardOptions o;
  o.name = "judge";
  o.kind = "http";
  o.url = "http://127.0.0.1:" + std::to_string(server.port()) + "/score";
  o.timeout_s = 1.5;
  auto fn = rl::make_external_reward(o);
  EXPECT_DOUBLE_EQ(fn->score(input("fine")).reward, 0.25);
  expect_failure(*fn, input("hang"), RewardFailure::kTimeout);
  expect_failure(*fn, input("garbage"), RewardFailure::kInvalidOutput, "not JSON");
  expect_failure(*fn, input("error"), RewardFailure::kCrashed, "HTTP 500");
  EXPECT_DOUBLE_EQ(fn->score(input("fine again")).reward, 0.25);
  o.url = "http://127.0.0.1:1/score";  // nothing listens
  expect_failure(*rl::make_external_reward(o), input("x"), RewardFailure::kCrashed);
}

TEST(ExternalReward, PythonUnitTestsExampleScoresCodeInTheSandbox) {
  auto o = command_options(fs::path(LORASYNC_SOURCE_DIR) / "examples/rewards/python_unit_tests.py", 20, 1);
  o.command.push_back("--test-timeout");
  o.command.push_back("1");
  auto fn = rl::make_external_reward(o);
  const std::vector<std::string> tests = {"assert add(2, 3) == 5", "assert add(-1, 1) == 0\nassert add(0, 0) == 0"};
  EXPECT_DOUBLE_EQ(fn->score(input("Here:\n```python\ndef add(a, b):\n    return a + b\n```\n", tests)).reward, 1.0);
  EXPECT_DOUBLE_EQ(fn->score(input("```python\ndef add(a, b):\n    return a + b + (a == 2)\n```", tests)).reward, 0.5);
  // Each test is killed after its 1 s (--test-timeout): the call answers 0, where a test left to
  // run would have ended the call at its 20 s deadline with a timeout (thrown, failing here).
  EXPECT_DOUBLE_EQ(fn->score(input("```python\ndef add(a, b):\n    while True: pass\n```", tests)).reward, 0.0);
  if (rl::network_isolation_available()) {
    const std::string net = "```python\nimport socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                            "def add(a, b):\n    return a + b\n```";
    EXPECT_DOUBLE_EQ(fn->score(input(net, tests)).reward, 0.0);  // no network inside the sandbox
  }
}

TEST(ExternalReward, RewardsTablesInTheTrainerConfiguration) {
  auto c = rl::TrainConfig::parse(R"(
[grpo]
reward_funcs = ["math_boxed", "unit_tests"]
reward_weights = [1.0, 0.5]
[rewards.unit_tests]
kind = "command"
command = ["python3", "score.py"]
workers = 3
timeout_s = 4.5
startup_s = 12
network = false
)", "t.toml", {"rewards.unit_tests.memory_mb=512", "rewards.judge.kind=\"http\"", "rewards.judge.url=\"http://h:1/s\""});
  ASSERT_EQ(c.rewards.size(), 2u);
  const auto& u = c.rewards.at("unit_tests");
  EXPECT_EQ(u.name, "unit_tests");
  EXPECT_EQ(u.command, (std::vector<std::string>{"python3", "score.py"}));
  EXPECT_EQ(u.workers, 3);
  EXPECT_DOUBLE_EQ(u.timeout_s, 4.5);
  EXPECT_DOUBLE_EQ(u.startup_s, 12);
  EXPECT_EQ(u.memory_mb, 512);
  EXPECT_EQ(c.rewards.at("judge").url, "http://h:1/s");
  // The resolved configuration (a run's config.toml) keeps them.
  auto again = rl::TrainConfig::parse(c.to_toml(), "config.toml");
  EXPECT_EQ(again.rewards.at("unit_tests").command, u.command);
  EXPECT_EQ(again.rewards.at("judge").kind, "http");
  auto expect_invalid = [](const std::string& toml, const std::string& needle) {
    try {
      auto bad = rl::TrainConfig::parse(toml, "bad.toml");
      bad.model.path = "m";
      bad.data.train_file = "d";
      bad.validate();
      ADD_FAILURE() << toml;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_invalid("[rewards.x]\nkind = \"command\"\nshell = \"rm -rf /\"\n", "unknown key rewards.x.shell");
  expect_invalid("[rewards.x]\nkind = \"ftp\"\n", "rewards.x.kind");
  expect_invalid("[rewards.x]\nkind = \"http\"\n", "rewards.x.url");
  expect_invalid("[rewards.\"a b\"]\nkind = \"http\"\n", "reward name");
}

}  // namespace
}  // namespace lorasync
