// Chaos suite (issue 16 "Proof" 1; label slow): `lorasync train`, `lorasync proxy` and two
// `lorasync serve` replicas (real binaries, loopback) while a supervisor, at seeded random
// times, kill -9s or SIGSTOPs one of them and restarts (or continues) it. The trainer restarts
// with --resume; a replica restarts empty and the proxy re-syncs it; a restarted proxy rebuilds
// its registry from the replicas. Invariants checked at the end:
//  - the run reaches its last step (the trainer exits 0 on its own; metrics steps 1..N, no gap);
//  - exactly once to the last step: every (epoch, prompt) the final checkpoint's cursor has passed
//    is trained once, abandoned with a reason, or owed by the final checkpoint (redo list or
//    stored queue), never two of these;
//  - every trained group names a version the trainer announced (groups.jsonl vs metrics);
//  - every replica holds exactly the intended adapters (none, after the trainer's final unload);
//  - no process is left behind.
// Longer by hand: LORASYNC_CHAOS_SEED=N LORASYNC_CHAOS_STEPS=200 LORASYNC_CHAOS_FAULTS=60
// ctest -R Chaos --output-on-failure. The faults injected and survived are printed.
#include <gtest/gtest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <dirent.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "util/child_process.h"
#include "util/files.h"
#include "util/http_client.h"
#include "util/jsonl.h"
#include "util/run_command.h"

namespace lorasync {
namespace {

using nlohmann::json;
using testing::ChildProcess;

long env_or(const char* name, long dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : dflt;
}

void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

// PIDs of processes whose command line mentions `needle` (leak check).
std::vector<int> processes_mentioning(const std::string& needle) {
  std::vector<int> out;
  DIR* d = opendir("/proc");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0 || pid == getpid()) continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/cmdline");
    std::string cmd((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (cmd.find(needle) != std::string::npos) out.push_back(pid);
  }
  closedir(d);
  return out;
}

class Chaos {
 public:
  Chaos() {
    model_ = dir_.path() / "tiny";
    auto r = testing::run_lorasync("init-model --preset tiny --seed 5 --init-std 0.1 --tokenizer " +
                                   testing::shell_quote(std::string(LORASYNC_SHARED_DIR) + "/data/qwen2-tokenizer") +
                                   " --output " + testing::shell_quote(model_.string()));
    if (r.exit_code != 0) throw std::runtime_error(r.err);
    std::ifstream in(std::string(LORASYNC_SHARED_DIR) + "/data/math_sanity_1k5.jsonl");
    std::ofstream out(dir_.path() / "train.jsonl");
    std::string line;
    for (int i = 0; i < kProblems && std::getline(in, line); ++i) out << line << "\n";
    bucket_ = dir_.path() / "run";
    fs::create_directories(bucket_);
  }

  static constexpr int kProblems = 16;

  // Starts (or restarts, on the port it had) replica i.
  void start_replica(int i) {
    const std::string port = ports_[i] ? std::to_string(ports_[i]) : "0";
    replicas_[i] = std::make_unique<ChildProcess>(std::vector<std::string>{
        LORASYNC_BINARY, "serve", "--model", model_.string(), "--served-model-name", "tiny", "--port", port,
        "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--max-loras", "4", "--max-lora-rank", "8",
        "--allowed-adapter-root", dir_.path().string(), "--threads", "1", "--shutdown-grace", "1"});
    auto l = replicas_[i]->read_line(60);
    if (!l) throw std::runtime_error("replica did not start: " + replicas_[i]->stderr_text());
    ports_[i] = static_cast<std::uint16_t>(json::parse(*l)["port"].get<int>());
  }

  void start_proxy() {
    const std::string listen = "127.0.0.1:" + std::to_string(proxy_port_);
    proxy_ = std::make_unique<ChildProcess>(std::vector<std::string>{
        LORASYNC_BINARY, "proxy", "--listen", listen, "--upstream", "http://127.0.0.1:" + std::to_string(ports_[0]),
        "--upstream", "http://127.0.0.1:" + std::to_string(ports_[1]), "--probe-interval", "0.5", "--probe-timeout", "1",
        "--eject-cooldown", "0.5", "--reconcile-interval", "1", "--adapter-retry-interval", "0.2", "--shutdown-grace", "1"});
    auto l = proxy_->read_line(30);
    if (!l) throw std::runtime_error("proxy did not start: " + proxy_->stderr_text());
    const std::string got = json::parse(*l)["listening"];
    proxy_port_ = static_cast<std::uint16_t>(std::stoi(got.substr(got.rfind(':') + 1)));
  }

  // max_staleness = 0: most steps drop a group as stale (the sync runs during the next step's
  // assembly) and requeue its prompt, so retries are queued and in flight at checkpoints and at the
  // run's end, where the exactly-once check below looks (with 1 the admission bound leaves
  // nothing to drop here).
  void write_config(int steps) {
    std::ofstream(config_) << "run_name = \"chaos\"\noutput_dir = \"" << bucket_.string() << "\"\nmax_steps = " << steps
                           << "\nseed = 11\n[model]\npath = \"" << model_.string()
                           << "\"\nserved_name = \"tiny\"\ndevice = \"cpu\"\ndtype = \"fp32\"\nthreads = 1\n"
                           << "[lora]\nrank = 4\nalpha = 8.0\n[data]\ntrain_file = \"" << (dir_.path() / "train.jsonl").string()
                           << "\"\nmax_prompt_tokens = 500\n[generation]\nserver_url = \"http://127.0.0.1:" << proxy_port_
                           << "\"\nmax_new_tokens = 8\ncontext_len = 1024\nserver_wait_s = 120\nrequest_timeout_s = 30\n"
                           << "[grpo]\nnum_generations = 4\n[async]\nmax_inflight = 16\nqueue_maxsize = 32\nscore_workers = 2\n"
                           << "max_staleness = 0\nretry_backoff_s = 0.2\nretry_backoff_max_s = 1\nmax_retries = 30\nserver_down_s = 300\n"
                           << "[batching]\nsamples_per_step = 8\nrow_tokens = 2048\nlogits_chunk = 512\n[optimizer]\nlr = 0.001\n"
                           << "[sync]\nweight_sync_steps = 1\nadapter_retry_interval = 0.2\n[checkpoint]\nsave_steps = 2\n"
                           << "[logging]\nmetrics_port = 0\n";
  }

  void start_trainer(bool resume) {
    std::vector<std::string> argv{LORASYNC_BINARY, "train", "--config", config_.string()};
    if (resume) argv.insert(argv.begin() + 2, "--resume");
    trainer_ = std::make_unique<ChildProcess>(argv);
    ++trainer_starts_;
  }
  bool has_checkpoint() const { return fs::exists(bucket_ / "checkpoints" / "latest"); }

  TempDir dir_{"lorasync-chaos"};
  fs::path model_, bucket_, config_ = dir_.path() / "chaos.toml";
  std::uint16_t ports_[2] = {0, 0}, proxy_port_ = 0;
  std::unique_ptr<ChildProcess> replicas_[2], proxy_, trainer_;
  int trainer_starts_ = 0;
};

TEST(Chaos, TrainerProxyAndReplicasSurviveKillsAndStops) {
  const long seed = env_or("LORASYNC_CHAOS_SEED", 1), steps = env_or("LORASYNC_CHAOS_STEPS", 80),
             max_faults = env_or("LORASYNC_CHAOS_FAULTS", 12);
  std::mt19937 rng(static_cast<unsigned>(seed));
  auto uniform = [&](double a, double b) { return std::uniform_real_distribution<double>(a, b)(rng); };
  Chaos c;
  c.start_replica(0);
  c.start_replica(1);
  c.start_proxy();
  c.write_config(static_cast<int>(steps));
  c.start_trainer(false);

  std::map<std::string, int> injected;  // "victim fault" -> count
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(env_or("LORASYNC_CHAOS_DEADLINE_S", 600));
  std::optional<int> exit_code;
  int faults = 0;
  std::string log;
  auto trainer_exit = [&]() -> std::optional<int> { return c.trainer_->wait_exit(0.05); };
  while (std::chrono::steady_clock::now() < deadline) {
    // Wait a random while, watching for the trainer's own exit.
    const double wait = uniform(0.8, 2.0);
    for (double t = 0; t < wait && !exit_code; t += 0.1) {
      exit_code = trainer_exit();
      if (!exit_code) sleep_s(0.05);
    }
    if (exit_code) break;
    if (faults >= max_faults) continue;
    // The trainer is a victim only once it has a checkpoint to resume from.
    const int nvictims = c.has_checkpoint() ? 4 : 3;
    const int victim = std::uniform_int_distribution<int>(0, nvictims - 1)(rng);  // 0,1 replica, 2 proxy, 3 trainer
    const bool kill9 = uniform(0, 1) < 0.6;
    const double pause = uniform(0.3, 2.0);
    ChildProcess* p = victim < 2 ? c.replicas_[victim].get() : victim == 2 ? c.proxy_.get() : c.trainer_.get();
    const std::string name = victim < 2 ? "replica" + std::to_string(victim) : victim == 2 ? "proxy" : "trainer";
    ++faults;
    ++injected[name + (kill9 ? " kill-9" : " stop")];
    log += fmt::format("{} {} ({:.1f} s)\n", name, kill9 ? "kill-9" : "stop", pause);
    if (kill9) {
      p->kill(SIGKILL);
      auto code = p->wait_exit(20);
      ASSERT_TRUE(code.has_value()) << name << " did not die";
      sleep_s(pause);
      if (victim < 2) c.start_replica(victim);
      else if (victim == 2) c.start_proxy();
      else c.start_trainer(true);
    } else {
      p->kill(SIGSTOP);
      sleep_s(pause);
      p->kill(SIGCONT);
    }
  }
  ASSERT_TRUE(exit_code.has_value()) << "the run did not finish in time; faults:\n" << log << c.trainer_->stderr_text();
  ASSERT_EQ(*exit_code, 0) << "faults:\n" << log << c.trainer_->stderr_text();

  // The run reached its last step, steps contiguous.
  auto metrics = testing::read_jsonl(c.bucket_ / "metrics.jsonl");
  ASSERT_EQ(static_cast<long>(metrics.size()), steps) << log;
  std::set<std::int64_t> versions;
  for (std::size_t i = 0; i < metrics.size(); ++i) {
    EXPECT_EQ(metrics[i]["step"], static_cast<int>(i) + 1);
    versions.insert(metrics[i]["version"].get<std::int64_t>());
  }
  // Exactly once, to the last step: against the final checkpoint, every (epoch, prompt) the cursor
  // has passed is trained once, abandoned (with its line), or owed (in the redo list or in the
  // stored queue), and none is more than one of them; one the cursor has not reached is none.
  std::map<std::pair<int, int>, int> trained, abandoned, owed;
  std::map<std::pair<int, int>, std::string> history;  // for a failure's message
  int requeued = 0;
  std::int64_t max_version = *versions.rbegin();
  for (const auto& g : testing::read_jsonl(c.bucket_ / "groups.jsonl")) {
    const std::pair<int, int> key{g["epoch"].get<int>(), g["prompt"].get<int>()};
    history[key] += fmt::format(" step {} attempt {}: {};", g["step"].get<int>(), g["attempt"].get<int>(), g["disposition"].get<std::string>());
    if (g["disposition"] == "abandoned") ++abandoned[key];
    if (g["disposition"] == "dropped_stale" || g["disposition"] == "cancelled") ++requeued;
    if (g["disposition"] != "trained") continue;
    ++trained[key];
    // Provenance: a version the trainer announced (1..the last), checked against its manifest
    // when the response arrived (a mismatch is refused as an invalid response).
    EXPECT_GE(g["version"].get<std::int64_t>(), 1);
    EXPECT_LE(g["version"].get<std::int64_t>(), max_version);
  }
  const fs::path ckpts = c.bucket_ / "checkpoints";
  std::string latest = read_file(ckpts / "latest");
  while (!latest.empty() && (latest.back() == '\n' || latest.back() == ' ')) latest.pop_back();
  ASSERT_EQ(latest, fmt::format("step-{:06d}", steps)) << "the final checkpoint is the last step's";
  const json state = json::parse(read_file(ckpts / latest / "state.json"));
  const json& cursor = state.at("cursor");
  for (const auto& r : cursor.at("redo")) ++owed[{r.at(1).get<int>(), r.at(0).get<int>()}];
  const json queue = json::parse(read_file(ckpts / latest / "queue.json"));
  for (const auto& g : queue.at("groups"))
    ++owed[{g.at("prompt").at(1).get<int>(), g.at("prompt").at(0).get<int>()}];
  const int epoch = cursor.at("epoch").get<int>(), position = cursor.at("position").get<int>();
  const auto permutation = cursor.at("permutation").get<std::vector<int>>();
  ASSERT_EQ(static_cast<int>(permutation.size()), Chaos::kProblems);  // every row is a problem: index = position
  std::set<std::pair<int, int>> passed;
  for (int e = 0; e < epoch; ++e)
    for (int p = 0; p < Chaos::kProblems; ++p) passed.insert({e, p});
  for (int i = 0; i < position; ++i) passed.insert({epoch, permutation[static_cast<std::size_t>(i)]});
  int trained_groups = 0;
  for (const auto* m : {&trained, &abandoned, &owed})
    for (const auto& [k, n] : *m) EXPECT_TRUE(passed.count(k)) << "epoch " << k.first << " prompt " << k.second << " is past the cursor";
  for (const auto& k : passed) {
    const int t = trained[k], a = abandoned[k], o = owed[k];
    EXPECT_EQ(t + a + o, 1) << "epoch " << k.first << " prompt " << k.second << ": trained " << t << ", abandoned " << a
                            << ", owed " << o << ";" << history[k] << " faults:\n" << log;
    trained_groups += t;
  }
  EXPECT_EQ(trained_groups, static_cast<int>(steps) * 8 / 4) << "each step trains 8 samples, 2 groups of 4";
  EXPECT_GT(requeued, 0) << "no group was dropped or cancelled as stale: the check saw no retry";
  // Every replica converges to the intended adapters: none of the run (the trainer unloaded them;
  // a replica that was down meanwhile is re-synced by the proxy).
  for (int i = 0; i < 2; ++i) {
    bool clean = false;
    for (int t = 0; t < 200 && !clean; ++t) {
      clean = testing::http_request(c.ports_[i], "GET", "/v1/models").body.find("policy-v") == std::string::npos;
      if (!clean) sleep_s(0.1);
    }
    EXPECT_TRUE(clean) << "replica " << i << ": " << testing::http_request(c.ports_[i], "GET", "/v1/models").body;
  }
  // No process left behind once the fleet is stopped.
  for (auto* p : {c.replicas_[0].get(), c.replicas_[1].get(), c.proxy_.get()}) {
    p->kill(SIGCONT);
    p->kill(SIGTERM);
    EXPECT_TRUE(p->wait_exit(30).has_value());
  }
  sleep_s(0.2);
  EXPECT_TRUE(processes_mentioning(c.dir_.path().string()).empty()) << "leaked processes";
  std::string summary;
  for (const auto& [k, n] : injected) summary += fmt::format("{}{} x{}", summary.empty() ? "" : ", ", k, n);
  std::printf("chaos: seed %ld, %ld steps, %d faults injected and survived (%s); trainer started %d times; %d groups "
              "dropped or cancelled as stale and requeued\n", seed, steps, faults, summary.c_str(), c.trainer_starts_, requeued);
}

}  // namespace
}  // namespace lorasync
