// `lorasync bench proxy`: the proxy (a child `lorasync proxy` process, one thread) in front of two
// in-process stub replicas (one thread serving both, by default: bench::StubFleet), driven by a
// GRPO-shaped trace at 32/128/384 concurrent requests.
// Baseline (same run): the same load sent directly to the stubs (round robin), in every round.
// Reports req/s, proxy-added latency p50/p99 (client latency minus the stub's reported service
// time; over the requests after each worker's first, with the p99 of all of them reported too),
// proxy CPU seconds per 1k requests (the scheduler's nanosecond counters of every proxy thread),
// proxy peak RSS, bytes per tracked block at 500k entries, routing counters and the stubs'
// ground-truth prefix reuse. With --reference, the same load through the HF Python proxy in the
// same run: CPU (also split into user and system time), latency, throughput, unmatched share and
// prefix reuse against it, and its table's bytes per tracked block, measured
// (bench/proxy/reference_block_bytes.py). Each round runs direct, ours, the reference, and the
// next one the other way round, so that a drift of the machine's pace hurts all sides alike; every
// single figure is the median (shares: the mean) over rounds on each side.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <utility>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "bench/proxy/grpo_trace.h"
#include "bench/proxy/stub_replica.h"
#include "bench_proxy.h"
#include "commands.h"
#include "proc_stats.h"
#include "http/client.h"
#include "proxy/block_table.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/process.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace bench_proxy {

std::string sh_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The reference's table filled to `entries` blocks through its own router
// (bench/proxy/reference_block_bytes.py, run by --python): its JSON summary, or {"error": ...}.
nlohmann::json reference_block_bytes(const BenchProxyOptions& o, std::int64_t entries) {
  const std::string cmd = sh_quote(o.python) + " " +
                          sh_quote(std::string(LORASYNC_SOURCE_DIR) + "/bench/proxy/reference_block_bytes.py") + " " +
                          sh_quote(o.reference) + " " + std::to_string(entries) + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {{"error", "cannot start " + o.python}};
  std::string text;
  char buf[4096];
  while (std::size_t k = std::fread(buf, 1, sizeof buf, p)) text.append(buf, k);
  const int rc = pclose(p);
  const auto brace = text.rfind('{');
  nlohmann::json j = rc == 0 && brace != std::string::npos ? nlohmann::json::parse(text.substr(brace), nullptr, false)
                                                           : nlohmann::json();
  if (!j.is_object() || !j.contains("bytes_per_block")) return {{"error", std::string(trim(text))}};
  return j;
}

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw_env("bench proxy: no free port");
  ::close(fd);
  return ntohs(a.sin_port);
}

bool port_open(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

Child spawn_proxy(const std::vector<std::string>& upstreams, int threads) {
  // The front (`lorasync`), whose proxy runs without libtorch, also when this bench runs in the
  // engine.
  const std::string self = lorasync_executable();
  int fds[2];
  if (pipe(fds) != 0) throw_env("pipe failed");
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    // Drop every inherited descriptor (the stubs' listening sockets among them).
    for (int fd = 3; fd < 65536; ++fd) close(fd);
    std::vector<std::string> args = {"lorasync", "--log-level", "warn", "proxy", "--listen", "127.0.0.1:0",
                                     "--threads", std::to_string(threads), "--stats-log-interval", "0",
                                     "--reconcile-interval", "0", "--upstream-token-env", ""};
    for (const auto& u : upstreams) {
      args.push_back("--upstream");
      args.push_back(u);
    }
    // LORASYNC_BENCH_PROXY_WRAPPER (for profiling, docs/benchmarks.md): a command the proxy runs
    // under, split on spaces, e.g. "valgrind --tool=callgrind --instr-atstart=no".
    std::string exe = self;
    if (const char* w = std::getenv("LORASYNC_BENCH_PROXY_WRAPPER"); w != nullptr && *w != 0) {
      std::vector<std::string> wrapped;
      for (const auto& part : split(w, ' '))
        if (!part.empty()) wrapped.emplace_back(part);
      if (wrapped.empty()) _exit(127);
      exe = wrapped.front();
      wrapped.emplace_back(self);
      wrapped.insert(wrapped.end(), args.begin() + 1, args.end());
      args = std::move(wrapped);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (exe.find('/') == std::string::npos) execvp(exe.c_str(), argv.data());
    else execv(exe.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  const std::string line = read_child_line(fds[0]);
  auto colon = line.rfind(':');
  if (colon == std::string::npos) throw_env("proxy child did not start: '{}'", line);
  Child ch;
  ch.pid = pid;
  ch.port = static_cast<std::uint16_t>(std::stoi(line.substr(colon + 1)));
  return ch;
}

// The reference proxy: `python3 FILE` with its environment (UPSTREAM_URLS, PROXY_PORT, HF_TOKEN).
Child spawn_reference(const BenchProxyOptions& o, const std::vector<std::string>& upstreams) {
  Child ch;
  ch.port = free_port();
  std::string urls;
  for (const auto& u : upstreams) urls += (urls.empty() ? "" : ",") + u;
  const pid_t pid = fork();
  if (pid == 0) {
    for (int fd = 3; fd < 65536; ++fd) close(fd);
    const int devnull = ::open("/dev/null", O_WRONLY);
    if (devnull >= 0) dup2(devnull, 1);
    setenv("UPSTREAM_URLS", urls.c_str(), 1);
    setenv("PROXY_PORT", std::to_string(ch.port).c_str(), 1);
    setenv("HF_TOKEN", "bench", 1);
    setenv("PROXY_STATS_EVERY_S", "0", 1);
    execlp(o.python.c_str(), o.python.c_str(), o.reference.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  ch.pid = pid;
  for (int i = 0; i < 300 && !port_open(ch.port); ++i) {
    int st = 0;
    if (waitpid(pid, &st, WNOHANG) == pid) throw_env("the reference proxy ({} {}) exited at start", o.python, o.reference);
    usleep(50000);
  }
  if (!port_open(ch.port)) throw_env("the reference proxy did not listen on {} within 15 s", ch.port);
  return ch;
}

void stop_child(const Child& ch) {
  kill(ch.pid, SIGTERM);
  int st = 0;
  waitpid(ch.pid, &st, 0);
}

std::string read_child_line(int fd) {
  std::string line;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') line += c;
  close(fd);
  return line;
}

}  // namespace bench_proxy

namespace {

using namespace bench_proxy;

struct RunResult {
  // Latency percentiles over the requests after each worker's first (the first opens the client's
  // connection, and behind it the proxy's to a stub: a one-time cost of a long-lived client that a
  // steady GRPO stream does not pay); p99_all_ms includes them.
  double req_per_s = 0, p50_ms = 0, p99_ms = 0, p99_all_ms = 0;
  std::size_t n = 0, errors = 0;
};

// Sends every trace request through `pools` (one chosen round robin) with `conc` workers.
RunResult drive(const std::vector<std::string>& urls, const std::vector<bench::TraceRequest>& trace, int conc,
                int client_threads) {
  boost::asio::io_context ioc;  // declared before the pools: they must go first
  std::vector<std::unique_ptr<http::Pool>> pools;
  {
    http::ClientOptions co;
    co.max_connections = 1024;
    std::string err;
    for (const auto& u : urls) pools.push_back(std::make_unique<http::Pool>(*http::Url::parse(u, err), co));
  }
  std::atomic<std::size_t> next{0}, errors{0};
  std::vector<double> added(trace.size(), 0);
  // LORASYNC_BENCH_PROXY_PICKS=PREFIX (diagnosis of routing, docs/benchmarks.md): each run through a
  // proxy writes PREFIX.N, a line per request: trace index, prompt, the order it was sent in, the
  // order its answer came back in, and the replica the proxy picked (X-Proxy-Upstream).
  const char* picks_prefix = std::getenv("LORASYNC_BENCH_PROXY_PICKS");
  std::vector<std::array<std::int64_t, 3>> picks(picks_prefix ? trace.size() : 0, {-1, -1, -1});
  std::atomic<std::int64_t> sent{0}, answered{0};
  http::Headers h;
  h.add("Content-Type", "application/json");
  const double t0 = now_seconds();
  for (int w = 0; w < conc; ++w)
    boost::asio::co_spawn(ioc, [&]() -> http::Task<void> {
      for (;;) {
        std::size_t i = next.fetch_add(1);
        if (i >= trace.size()) co_return;
        auto& pool = *pools[i % pools.size()];
        double s = now_seconds();
        if (!picks.empty()) picks[i][0] = sent.fetch_add(1);
        auto f = co_await pool.fetch({"POST", "/v1/completions", &h, trace[i].body}, http::CallOptions{}, 1 << 20);
        double lat = now_seconds() - s;
        if (!picks.empty()) {
          picks[i][1] = answered.fetch_add(1);
          if (const auto* v = f.headers.find("X-Proxy-Upstream")) picks[i][2] = std::stoll(*v);
        }
        if (f.error != http::CallError::kNone || f.status != 200) {
          ++errors;
          continue;
        }
        double service = 0;
        if (const auto* v = f.headers.find("X-Stub-Service-Us")) service = std::stod(*v) / 1e6;
        added[i] = (lat - service) * 1000.0;
      }
    }, boost::asio::detached);
  std::vector<std::thread> ts;
  for (int t = 1; t < client_threads; ++t) ts.emplace_back([&] { ioc.run(); });
  ioc.run();
  for (auto& t : ts) t.join();
  if (!picks.empty() && urls.size() == 1) {
    static int run_no = 0;
    std::ofstream out(std::string(picks_prefix) + "." + std::to_string(run_no++));
    for (std::size_t i = 0; i < trace.size(); ++i)
      out << i << ' ' << trace[i].prompt_index << ' ' << picks[i][0] << ' ' << picks[i][1] << ' ' << picks[i][2] << '\n';
  }
  RunResult r;
  double dt = now_seconds() - t0;
  r.n = trace.size();
  r.errors = errors.load();
  r.req_per_s = static_cast<double>(r.n) / dt;
  r.p99_all_ms = percentile(added, 99);
  const std::size_t first_round = std::min(trace.size(), static_cast<std::size_t>(std::max(0, conc)));
  std::vector<double> steady(added.begin() + static_cast<std::ptrdiff_t>(first_round), added.end());
  if (steady.empty()) steady = added;
  r.p50_ms = percentile(steady, 50);
  r.p99_ms = percentile(steady, 99);
  return r;
}

// A Pool's connections belong to the io_context that opened them: use a fresh pool here.
nlohmann::json get_json(const std::string& base_url, const std::string& target) {
  std::string err;
  boost::asio::io_context ioc;  // outlives the pool
  http::Pool pool(*http::Url::parse(base_url, err), http::ClientOptions{});
  nlohmann::json out;
  boost::asio::co_spawn(ioc, [&]() -> http::Task<void> {
    auto f = co_await pool.fetch({"GET", target, nullptr, ""}, http::CallOptions{}, 16 << 20);
    if (f.error == http::CallError::kNone) out = nlohmann::json::parse(f.body, nullptr, false);
  }, boost::asio::detached);
  ioc.run();
  return out;
}

// One proxy (ours or the reference) under the trace: its CPU per request and peak RSS over the
// run, and the router counters of its /proxy/stats; then it is stopped.
struct Round {
  RunResult run;
  double cpu_ms = 0, rss = 0;
  // cpu_ms split by the kernel's user/system tick ratio over the round (proc_user_sys_ticks): the
  // system part is mostly loopback TCP (each send runs the receiver's TCP input and wake-up) and the
  // proxy's other system calls (docs/proxy.md counts them per request for both proxies).
  double cpu_user_ms = 0, cpu_sys_ms = 0;
  double reuse = 0;  // the stubs' prefill reuse over the round: the routing's ground truth
  nlohmann::json router;  // /proxy/stats "router": both proxies count routed, affinity, spilled, unmatched
  double share(const char* outcome) const {
    const double routed = router.is_object() ? router.value("routed", 0.0) : 0.0;
    return routed > 0 ? router.value(outcome, 0.0) / routed : 0.0;
  }
};

Round measure_round(const Child& ch, const std::vector<bench::TraceRequest>& trace, int conc, int client_threads) {
  const std::string url = "http://127.0.0.1:" + std::to_string(ch.port);
  Round r;
  const double cpu0 = proc_cpu_s(ch.pid);
  const auto [u0, s0] = proc_user_sys_ticks(ch.pid);
  r.run = drive({url}, trace, conc, client_threads);
  r.cpu_ms = (proc_cpu_s(ch.pid) - cpu0) * 1000.0 / static_cast<double>(trace.size());
  const auto [u1, s1] = proc_user_sys_ticks(ch.pid);
  const double du = u1 - u0, ds = s1 - s0;
  const double sys_share = du + ds > 0 ? ds / (du + ds) : 0;
  r.cpu_sys_ms = r.cpu_ms * sys_share;
  r.cpu_user_ms = r.cpu_ms - r.cpu_sys_ms;
  r.rss = proc_status_mib(ch.pid, "VmHWM");
  const nlohmann::json stats = get_json(url, "/proxy/stats");
  if (stats.is_object() && stats.contains("router")) r.router = stats["router"];
  stop_child(ch);
  return r;
}

int run(const BenchProxyOptions& o) {
  if (o.stubs == "python") return run_python_stubs(o);
  BenchReporter rep;
  // Memory per tracked block at 500k entries: ours' table (slab and index), and with --reference the
  // reference's, filled to as many blocks through its own router in the same run (no ratio without).
  {
    const std::int64_t n = o.tracked_blocks;
    proxy::BlockTable t(static_cast<std::size_t>(n));
    for (std::uint64_t i = 0; i < static_cast<std::uint64_t>(n); ++i) t.find_or_insert(proxy::hash128(&i, sizeof i));
    const double per = static_cast<double>(t.memory_bytes()) / static_cast<double>(n);
    nlohmann::json c = {{"entries", n}, {"method", "BlockTable::memory_bytes() (slab and index) / entries"}};
    std::optional<double> ref;
    if (o.reference.empty()) {
      c["baseline"] = "none (--reference measures the reference's table)";
    } else {
      const nlohmann::json r = reference_block_bytes(o, n);
      if (r.contains("error")) {
        std::fprintf(stderr, "bench proxy: the reference's bytes per tracked block: %s\n", r["error"].dump().c_str());
        c["baseline"] = "none (the reference's table could not be measured)";
        c["reference_error"] = r["error"];
      } else {
        ref = r["bytes_per_block"].get<double>();
        c["baseline"] = "the reference's table, filled to as many blocks through its router, same run";
        c["reference_entries"] = r["entries"];
        c["reference_method"] = r["method"];
      }
    }
    rep.emit({"proxy", "bytes_per_tracked_block", per, "B", ref, c});
  }
  for (const auto& cs : split(o.concurrency, ',')) {
    int conc = std::stoi(std::string(trim(cs)));
    bench::StubOptions so;
    so.latency_s = o.stub_latency;
    so.latency_spread = o.stub_latency_spread;
    so.nice = o.stub_nice;
    so.threads = 1;
    bench::StubFleet stubs(so, 2, o.stub_threads == "shared");
    stubs.start();
    bench::StubReplica &s0 = stubs[0], &s1 = stubs[1];
    const std::vector<std::string> urls = stubs.urls();
    bench::TraceOptions to;
    to.prompts = o.prompts;
    auto trace = bench::make_grpo_trace(to);
    // Rounds, each from cold stub caches, `rounds` times (the VM's noise moves single figures by
    // tens of per cent; the medians and the per-round pairs are reported): the baseline (direct to
    // the stubs), ours, the reference; the next round the other way round (reference, ours, direct),
    // so that neither proxy always runs first nor always follows the same run.
    std::vector<Round> ours, refs;
    std::vector<RunResult> direct;
    std::vector<std::string> first;  // per round, which of ours and the reference ran first
    // One round of a proxy from cold stub caches (reset, so the stubs' prefill reuse reflects that
    // proxy's routing only).
    auto cold_round = [&](const Child& ch) {
      for (const auto& u : urls) get_json(u, "/reset_prefix_cache");
      const std::uint64_t p0 = s0.prompt_tokens() + s1.prompt_tokens(), c0 = s0.cached_tokens() + s1.cached_tokens();
      Round r = measure_round(ch, trace, conc, o.client_threads);
      const std::uint64_t pt = s0.prompt_tokens() + s1.prompt_tokens() - p0,
                          ct = s0.cached_tokens() + s1.cached_tokens() - c0;
      r.reuse = pt ? static_cast<double>(ct) / static_cast<double>(pt) : 0;
      return r;
    };
    auto direct_round = [&] {
      for (const auto& u : urls) get_json(u, "/reset_prefix_cache");
      direct.push_back(drive(urls, trace, conc, o.client_threads));
      if (o.stub_nice != 0 && (s0.nice_applied() != 1 || s1.nice_applied() != 1))
        throw_env("bench proxy: --stub-nice {}: the stubs' threads could not take it (a value below 0 needs "
                  "CAP_SYS_NICE)",
                  o.stub_nice);
    };
    for (int round = 0; round < std::max(1, o.rounds); ++round) {
      const bool forward = round % 2 == 0;
      if (forward) direct_round();
      if (forward || o.reference.empty()) {
        ours.push_back(cold_round(spawn_proxy(urls, o.proxy_threads)));
        // The reference proxy, same stubs, same trace.
        if (!o.reference.empty()) refs.push_back(cold_round(spawn_reference(o, urls)));
      } else {
        refs.push_back(cold_round(spawn_reference(o, urls)));
        ours.push_back(cold_round(spawn_proxy(urls, o.proxy_threads)));
      }
      if (!o.reference.empty()) first.emplace_back(forward ? "ours" : "reference");
      if (!forward) direct_round();
    }
    const int R = static_cast<int>(ours.size());
    auto med = [](auto& v, auto f) {
      std::vector<double> xs;
      for (const auto& x : v) xs.push_back(f(x));
      return percentile(xs, 50);
    };
    auto mean = [](auto& v, auto f) {
      double s = 0;
      for (const auto& x : v) s += f(x);
      return v.empty() ? 0.0 : s / static_cast<double>(v.size());
    };
    auto list = [](auto& v, auto f) {
      nlohmann::json a = nlohmann::json::array();
      for (const auto& x : v) a.push_back(f(x));
      return a;
    };
    std::size_t errors = 0;
    for (const auto& r : ours) errors += r.run.errors;
    // What the stubs answered per choice (completion_body.h: serve's shape, max_tokens tokens).
    const std::uint64_t choices = s0.choices() + s1.choices();
    const double bytes_per_choice =
        choices ? static_cast<double>(s0.body_bytes() + s1.body_bytes()) / static_cast<double>(choices) : 0.0;
    nlohmann::json cfg = {{"concurrency", conc}, {"requests", trace.size()}, {"stubs", "cpp"},
                          {"max_tokens", to.max_tokens}, {"body_bytes_per_choice", std::lround(bytes_per_choice)},
                          {"stub_latency_s", o.stub_latency},
                          {"stub_latency_spread", o.stub_latency_spread},
                          {"stub_nice", o.stub_nice}, {"stub_threads", o.stub_threads},
                          {"proxy_threads", o.proxy_threads}, {"errors", errors},
                          {"baseline", "direct to stubs, the median over the same rounds"}, {"rounds", R}};
    // The per-round figures read for both proxies.
    auto cpu_of = [](const Round& r) { return r.cpu_ms; };
    auto reuse_of = [](const Round& r) { return r.reuse; };
    auto unmatched_of = [](const Round& r) { return r.share("unmatched"); };
    auto p99_of = [](const Round& r) { return r.run.p99_ms; };
    auto rps_of = [](const Round& r) { return r.run.req_per_s; };
    // Per round, ours minus the reference's, in points (f: a share).
    auto pts_over_reference = [&](auto f) {
      std::vector<double> d;
      for (int i = 0; i < R; ++i) d.push_back((f(ours[i]) - f(refs[i])) * 100.0);
      return d;
    };
    // Single figures: the median over rounds (for one round, that round's).
    const double cpu_ms = med(ours, cpu_of);
    const double unmatched = mean(ours, unmatched_of);
    if (!refs.empty()) {
      nlohmann::json rc = cfg;
      rc["baseline"] = "the reference proxy (Python), same run";
      rc["reference_errors"] = list(refs, [](const Round& r) { return r.run.errors; });
      rc["first_per_round"] = first;
      nlohmann::json ratios = nlohmann::json::array();
      for (int i = 0; i < R; ++i) ratios.push_back(ours[i].cpu_ms / refs[i].cpu_ms);
      nlohmann::json c1 = rc;
      c1["round_ratios"] = ratios;
      c1["ours_per_round"] = list(ours, cpu_of);
      c1["reference_per_round"] = list(refs, cpu_of);
      rep.emit({"proxy", "cpu_ms_per_request_vs_reference", cpu_ms, "ms", med(refs, cpu_of), c1});
      // The same CPU split into user and system time (an estimate from the kernel's tick ratio).
      for (const bool user : {true, false}) {
        auto part = [user](const Round& r) { return user ? r.cpu_user_ms : r.cpu_sys_ms; };
        nlohmann::json cu = rc;
        cu["ours_per_round"] = list(ours, part);
        cu["reference_per_round"] = list(refs, part);
        cu["split"] = "proc_cpu_s by the utime/stime tick ratio of /proc/PID/stat over the round";
        rep.emit({"proxy", user ? "cpu_user_ms_per_request_vs_reference" : "cpu_sys_ms_per_request_vs_reference",
                  med(ours, part), "ms", med(refs, part), cu});
      }
      rep.emit({"proxy", "added_latency_p99_ms_vs_reference", med(ours, p99_of), "ms", med(refs, p99_of), rc});
      rep.emit({"proxy", "requests_per_s_vs_reference", med(ours, rps_of), "req/s", med(refs, rps_of), rc});
      // The share of unmatched requests: the mean over rounds, and the per-round difference.
      nlohmann::json c2 = rc;
      c2["ours_per_round"] = list(ours, unmatched_of);
      c2["reference_per_round"] = list(refs, unmatched_of);
      c2["spilled_ours_per_round"] = list(ours, [](const Round& r) { return r.share("spilled"); });
      c2["spilled_reference_per_round"] = list(refs, [](const Round& r) { return r.share("spilled"); });
      rep.emit({"proxy", "unmatched_fraction_vs_reference", unmatched, "fraction", mean(refs, unmatched_of), c2});
      const std::vector<double> diff = pts_over_reference(unmatched_of);
      double m = 0, v = 0;
      for (double d : diff) m += d / R;
      for (double d : diff) v += (d - m) * (d - m) / std::max(1, R - 1);
      nlohmann::json c3 = rc;
      c3["per_round"] = diff;
      c3["sd"] = std::sqrt(v);
      rep.emit({"proxy", "unmatched_pts_over_reference", m, "pt", std::nullopt, c3});
      // What the routing is for: the share of prompt tokens the stubs found in their prefix cache,
      // ours against the reference's (the mean over rounds, and the per-round difference).
      nlohmann::json c4 = rc;
      c4["ours_per_round"] = list(ours, reuse_of);
      c4["reference_per_round"] = list(refs, reuse_of);
      c4["pts_over_reference_per_round"] = pts_over_reference(reuse_of);
      rep.emit({"proxy", "stub_prefill_reuse_vs_reference", mean(ours, reuse_of), "fraction", mean(refs, reuse_of), c4});
      // Peak resident memory of each proxy process over its rounds (VmHWM; the table fills as the
      // trace goes).
      auto peak = [](const std::vector<Round>& rounds) {
        double hwm = 0;
        for (const auto& r : rounds) hwm = std::max(hwm, r.rss);
        return hwm;
      };
      rep.emit({"proxy", "proxy_peak_rss_mb_vs_reference", peak(ours), "MiB", peak(refs), rc});
    }
    // Against direct access: the median over rounds on both sides, the per-round values in the config.
    auto vs_direct = [&](const char* metric, const char* unit, double RunResult::*f) {
      nlohmann::json c = cfg;
      c["ours_per_round"] = list(ours, [f](const Round& r) { return r.run.*f; });
      c["direct_per_round"] = list(direct, [f](const RunResult& r) { return r.*f; });
      rep.emit({"proxy", metric, med(ours, [f](const Round& r) { return r.run.*f; }), unit,
                med(direct, [f](const RunResult& r) { return r.*f; }), c});
    };
    vs_direct("requests_per_s", "req/s", &RunResult::req_per_s);
    vs_direct("added_latency_p50_ms", "ms", &RunResult::p50_ms);
    vs_direct("added_latency_p99_ms", "ms", &RunResult::p99_ms);
    vs_direct("added_latency_p99_ms_incl_connect", "ms", &RunResult::p99_all_ms);
    // The rows below have no baseline (direct access has no proxy to measure).
    cfg["baseline"] = "none";
    {
      nlohmann::json c1 = cfg;
      c1["per_round"] = list(ours, cpu_of);
      rep.emit({"proxy", "cpu_s_per_1k_requests", cpu_ms, "s", std::nullopt, c1});
    }
    double rss = 0;
    for (const auto& r : ours) rss = std::max(rss, r.rss);
    rep.emit({"proxy", "proxy_peak_rss_mb", rss, "MiB", std::nullopt, cfg});
    if (ours.back().router.is_object()) {
      const auto& last = ours.back().router;  // the counters of the last round
      auto c2 = cfg;
      c2["affinity"] = last["affinity"];
      c2["spilled"] = last["spilled"];
      // Ours only: the decisions --spill-wait held, by how the wait ended (kept affinity or spilled).
      if (last.contains("spill_waits_kept")) {
        c2["spill_waits_kept"] = last["spill_waits_kept"];
        c2["spill_waits_spilled"] = last["spill_waits_spilled"];
      }
      c2["unmatched"] = last["unmatched"];
      c2["tracked_blocks"] = last["tracked_blocks"];
      c2["per_round"] = list(ours, unmatched_of);
      // 1/G is a floor (each group's first request has no prefix to follow), not a measurement: a
      // target in the config, no ratio.
      c2["baseline"] = "none";
      c2["floor"] = 1.0 / to.group;
      c2["floor_is"] = "1/G: a bound (the goal: within 2 points of it), not a measurement";
      c2["pts_over_floor"] = (unmatched - 1.0 / to.group) * 100.0;
      rep.emit({"proxy", "unmatched_fraction", unmatched, "fraction", std::nullopt, c2});
      c2.erase("floor");
      c2.erase("floor_is");
      c2.erase("pts_over_floor");
      c2["per_round"] = list(ours, [](const Round& r) { return r.share("affinity"); });
      rep.emit({"proxy", "affinity_fraction", mean(ours, [](const Round& r) { return r.share("affinity"); }), "fraction",
                std::nullopt, c2});
    }
    rep.emit({"proxy", "stub_prefill_reuse", mean(ours, reuse_of), "fraction", std::nullopt, cfg});
    rep.emit({"proxy", "stub_body_bytes_per_choice", bytes_per_choice, "B", std::nullopt, cfg});
    stubs.stop();
  }
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_proxy(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchProxyOptions>();
  auto* sub = bench.add_subcommand("proxy", "the proxy in front of stub replicas on a GRPO trace");
  sub->add_option("--concurrency", o->concurrency, "comma list")->capture_default_str();
  sub->add_option("--prompts", o->prompts, "GRPO prompts (x G=8 requests)")->capture_default_str();
  sub->add_option("--stub-latency", o->stub_latency, "stub service time, s")->capture_default_str()->check(CLI::Range(0.0, 3600.0));
  sub->add_option("--stub-latency-spread", o->stub_latency_spread,
                  "each completion's service time uniform in latency x [1 - S, 1 + S] (generation lengths vary; 0: fixed)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  sub->add_option("--stub-nice", o->stub_nice,
                  "the stub replicas' threads' nice value, e.g. -10 so that they answer when asked, as replicas on their "
                  "own machines would (below 0 needs CAP_SYS_NICE; 0: unchanged)")
      ->capture_default_str()
      ->check(CLI::Range(-20, 19));
  sub->add_option("--stub-threads", o->stub_threads,
                  "shared: one thread serves both stub replicas, so that their answers leave in the order their "
                  "service times end, as from machines of their own; per-replica: a thread each, ordered by the "
                  "host's scheduler when the cores are busy")
      ->capture_default_str()
      ->check(CLI::IsMember({"shared", "per-replica"}));
  sub->add_option("--proxy-threads", o->proxy_threads)->capture_default_str();
  sub->add_option("--client-threads", o->client_threads)->capture_default_str();
  sub->add_option("--reference", o->reference,
                  "the HF Python proxy's lora_proxy.py (fetched into a temp dir; run with python3-aiohttp) as a same-run baseline");
  sub->add_option("--python", o->python, "the interpreter for --reference and --stubs python")->capture_default_str();
  sub->add_option("--stubs", o->stubs,
                  "cpp: in-process C++ stub replicas and client; python: stub replicas and a load client as Python "
                  "processes on the same cores (bench/proxy/py_stubs.py, py_client.py), as an independent harness; "
                  "CPU rows only")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpp", "python"}));
  sub->add_option("--rounds", o->rounds,
                  "rounds per concurrency (direct, ours, the reference, each from cold caches; the order reversed "
                  "every other round); figures are medians, unmatched shares means, with the per-round values in "
                  "the config")
      ->capture_default_str()
      ->check(CLI::Range(1, 50));
  sub->add_option("--tracked-blocks", o->tracked_blocks,
                  "entries of the bytes-per-tracked-block figure (ours' table and, with --reference, the reference's)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1000}, std::int64_t{10000000}));
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
