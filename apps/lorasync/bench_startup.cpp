// `lorasync bench startup`: what the front executable saves a proxy (docs/architecture.md, "Two
// executables"). The same `proxy` command is started N times from `lorasync` (the front, no
// libtorch) and N times from `lorasync-engine` (libtorch linked), alternating which goes first in
// each pair, and each start is measured the same way:
//   start_ms      from fork() to the proxy's {"listening": ...} line on its stdout;
//   rss_mib       its resident memory (VmRSS) once listening and idle (--settle-ms later);
//   start_cpu_ms  the CPU time its threads spent up to then (/proc/PID/task/*/schedstat).
// Rows: the front's median against the engine's median, and the front's best against the
// engine's best (never one statistic against the other); the ratio is front / engine.
// The proxy is pointed at an upstream nobody listens on: nothing is routed, only started.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "proc_stats.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/process.h"

namespace lorasync::cli {
namespace {

struct BenchStartupOptions {
  int starts = 10;       // starts of each executable
  int settle_ms = 200;   // wait after the listening line before reading the resident memory
  double timeout_s = 60;  // per start
};

struct Start {
  double start_ms = 0, rss_mib = 0, cpu_ms = 0;
};

std::string dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

Start start_once(const std::string& exe, const BenchStartupOptions& o) {
  int fds[2];
  if (::pipe(fds) != 0) throw_env("pipe failed");
  const double t0 = now_seconds();
  const pid_t pid = ::fork();
  if (pid < 0) throw_env("fork failed");
  if (pid == 0) {
    ::dup2(fds[1], 1);
    const int devnull = ::open("/dev/null", O_WRONLY);
    if (devnull >= 0) ::dup2(devnull, 2);
    for (int fd = 3; fd < 1024; ++fd) ::close(fd);
    // An upstream on a port nobody listens on (the discard port): the proxy starts, routes nothing.
    std::vector<std::string> args = {exe, "--log-level", "warn", "proxy", "--listen", "127.0.0.1:0", "--upstream",
                                     "http://127.0.0.1:9", "--threads", "1", "--stats-log-interval", "0",
                                     "--reconcile-interval", "0", "--upstream-token-env", ""};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string line;
  bool done = false;
  while (!done) {
    const double left = o.timeout_s - (now_seconds() - t0);
    pollfd p{fds[0], POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) break;
    char c = 0;
    if (::read(fds[0], &c, 1) != 1) break;
    if (c == '\n') done = true;
    else line += c;
  }
  Start s;
  s.start_ms = (now_seconds() - t0) * 1000.0;
  ::close(fds[0]);
  const bool listening = done && line.find("\"listening\"") != std::string::npos;
  if (listening) {
    std::this_thread::sleep_for(std::chrono::milliseconds(o.settle_ms));
    s.rss_mib = proc_status_mib(pid, "VmRSS");
    s.cpu_ms = proc_cpu_s(pid) * 1000.0;
  }
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
  if (!listening)
    throw_env("{} proxy did not print its listening line within {} s (got '{}')", exe, o.timeout_s, line);
  return s;
}

double median(std::vector<double> v) { return percentile(std::move(v), 50); }
double best(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

int run(const BenchStartupOptions& o) {
  if (o.starts < 1) throw_invalid("--starts must be at least 1");
  // The front beside this executable, and the engine beside the front.
  const std::string front = lorasync_executable();
  const std::string engine = dir_of(front) + "/lorasync-engine";
  if (::access(engine.c_str(), X_OK) != 0) throw_not_found("lorasync-engine is not beside {}", front);
  start_once(front, o);  // warm the page cache for both before timing
  start_once(engine, o);
  std::vector<Start> fs, es;
  alternate_pairs(o.starts, [&](bool candidate) {
    Start s = start_once(candidate ? front : engine, o);
    (candidate ? fs : es).push_back(s);
    return s.start_ms;
  });
  BenchReporter rep;
  const nlohmann::json cfg = {{"starts", o.starts}, {"settle_ms", o.settle_ms}, {"command", "proxy"},
                              {"baseline", "lorasync-engine proxy (libtorch linked)"}};
  auto col = [](const std::vector<Start>& v, double Start::*f) {
    std::vector<double> out;
    for (const auto& s : v) out.push_back(s.*f);
    return out;
  };
  struct Metric {
    const char* name;
    double Start::*field;
    const char* unit;
  };
  for (const Metric m : {Metric{"start_ms", &Start::start_ms, "ms"}, Metric{"rss_mib", &Start::rss_mib, "MiB"},
                         Metric{"start_cpu_ms", &Start::cpu_ms, "ms"}}) {
    const auto f = col(fs, m.field), e = col(es, m.field);
    nlohmann::json c = cfg;
    c["statistic"] = "median";
    rep.emit({"startup", std::string(m.name) + "_median", median(f), m.unit, median(e), c});
    c["statistic"] = "best";
    rep.emit({"startup", std::string(m.name) + "_best", best(f), m.unit, best(e), c});
  }
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_startup(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchStartupOptions>();
  auto* sub = bench.add_subcommand(
      "startup", "a proxy started from the front (no libtorch) vs from lorasync-engine: start time, resident memory, CPU");
  sub->add_option("--starts", o->starts, "starts of each executable (alternating)")->capture_default_str();
  sub->add_option("--settle-ms", o->settle_ms, "wait after listening before reading VmRSS")->capture_default_str();
  sub->add_option("--timeout", o->timeout_s, "seconds a start may take")->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
