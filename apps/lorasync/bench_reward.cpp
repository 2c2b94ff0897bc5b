// `lorasync bench reward`: the cost of an external reward call (rl/external_reward.h).
//
// Three ways to score the same completion, same run:
//   baseline   the built-in math_boxed reward, in process
//   command    a sandboxed Python worker answering {"reward": 0.5} per JSON line (one worker,
//              sequential calls: the per-call round trip), and `--parallel` workers called from as
//              many threads (calls/s, what a GRPO group scored in parallel sees)
//   http       a local HTTP reward server (lorasync's own server) answering the same; each call
//              on its own connection and thread, as the trainer makes them
// Reported: µs per call (p50, p99) against the baseline's, and calls/s. The worker's own work is
// nil, so the figures are the overhead a real reward pays on top of its own computation.
#include <utility>  // before Asio's coroutine headers (Boost 1.74 + g++ 12)

#include <atomic>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "http/server.h"
#include "reward/reward_fn.h"
#include "rl/external_reward.h"
#include "util/bench_report.h"
#include "util/files.h"

namespace lorasync::cli {
namespace {

struct BenchRewardOptions {
  double seconds = 2.0;  // minimum time per method
  int parallel = 8;      // workers and threads of the parallel command row
};

struct Timed {
  double p50_us = 0, p99_us = 0, calls_per_s = 0;
  long long n = 0;
};

Timed time_calls(const reward::RewardFunction& fn, const reward::RewardInput& in, double min_seconds) {
  std::vector<double> us;
  const double start = now_seconds();
  do {
    for (int i = 0; i < 16; ++i) {
      const double t0 = now_seconds();
      fn.score(in);
      us.push_back((now_seconds() - t0) * 1e6);
    }
  } while (now_seconds() - start < min_seconds);
  Timed t;
  t.n = static_cast<long long>(us.size());
  t.p50_us = percentile(us, 50);
  t.p99_us = percentile(us, 99);
  t.calls_per_s = static_cast<double>(t.n) / (now_seconds() - start);
  return t;
}

double parallel_calls_per_s(const reward::RewardFunction& fn, const reward::RewardInput& in, int threads,
                            double min_seconds) {
  std::atomic<long long> n{0};
  const double start = now_seconds();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&] {
      do {
        fn.score(in);
        ++n;
      } while (now_seconds() - start < min_seconds);
    });
  for (auto& t : ts) t.join();
  return static_cast<double>(n.load()) / (now_seconds() - start);
}

int run(const BenchRewardOptions& o) {
  TempDir dir("lorasync-bench-reward");
  const fs::path script = dir.path() / "constant.py";
  std::ofstream(script) << "import sys\nfor line in sys.stdin:\n    sys.stdout.write('{\"reward\": 0.5}\\n'); sys.stdout.flush()\n";
  const std::string completion =
      "We add the two numbers and simplify the fraction step by step, checking the sign.\n"
      "So the total is $\\frac{3}{4} + \\frac{1}{4} = 1$, and the answer is $\\boxed{1}$.";
  reward::RewardInput in;
  in.prompt = "What is 3/4 + 1/4?";
  in.completion = completion;
  in.finish_reason = "stop";
  in.references = {"1"};

  BenchReporter rep;
  auto builtin = reward::make_reward_function("math_boxed");
  Timed base = time_calls(*builtin, in, o.seconds);

  rl::ExternalRewardOptions co;
  co.name = "constant";
  co.kind = "command";
  co.command = {"python3", script.string()};
  co.workers = 1;
  auto command = rl::make_external_reward(co);
  command->score(in);  // start the worker outside the timing
  Timed cmd = time_calls(*command, in, o.seconds);
  nlohmann::json ccfg = {{"worker", "python3, one JSON line each way"}, {"workers", 1},
                         {"network_namespace", rl::network_isolation_available()}, {"baseline", "math_boxed in process"}};
  rep.emit({"reward", "command_p50_us_per_call", cmd.p50_us, "us", base.p50_us, ccfg});
  rep.emit({"reward", "command_p99_us_per_call", cmd.p99_us, "us", base.p99_us, ccfg});
  co.workers = o.parallel;
  auto pool = rl::make_external_reward(co);
  const double pool_rate = parallel_calls_per_s(*pool, in, o.parallel, o.seconds);
  const double base_rate = parallel_calls_per_s(*builtin, in, o.parallel, o.seconds);
  ccfg["workers"] = o.parallel;
  ccfg["threads"] = o.parallel;
  rep.emit({"reward", "command_calls_per_s_parallel", pool_rate, "calls/s", base_rate, ccfg});

  http::ServerOptions so;
  so.threads = 1;
  http::Server server(so, [](http::Request&, http::ResponseWriter& w) -> http::Task<void> {
    co_await w.send(http::json_response(200, "{\"reward\": 0.5}"));
  });
  server.start();
  rl::ExternalRewardOptions ho;
  ho.name = "constant_http";
  ho.kind = "http";
  ho.url = "http://127.0.0.1:" + std::to_string(server.port()) + "/score";
  ho.workers = o.parallel;
  auto http_reward = rl::make_external_reward(ho);
  Timed web = time_calls(*http_reward, in, o.seconds);
  nlohmann::json hcfg = {{"server", "lorasync http::Server, 1 io thread, loopback"},
                         {"connection", "one per call, on its own thread"}, {"baseline", "math_boxed in process"}};
  rep.emit({"reward", "http_p50_us_per_call", web.p50_us, "us", base.p50_us, hcfg});
  rep.emit({"reward", "http_p99_us_per_call", web.p99_us, "us", base.p99_us, hcfg});
  server.stop(1.0);
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_reward(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchRewardOptions>();
  auto* sub = bench.add_subcommand("reward", "external rewards: cost per call of a command worker and an HTTP server");
  sub->add_option("--seconds", o->seconds, "minimum time per method")->capture_default_str();
  sub->add_option("--parallel", o->parallel, "workers and calling threads of the parallel row")->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
