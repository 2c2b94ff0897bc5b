// Command rewards: a pool of sandboxed worker processes speaking JSON lines (contracts in
// external_reward.h). HTTP rewards are in external_reward_http.cpp.
#include "rl/external_reward.h"

#include <fcntl.h>
#include <linux/close_range.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "util/error.h"
#include "util/log.h"

namespace lorasync::rl {

using reward::RewardCallFailed;
using reward::RewardFailure;
using reward::RewardFunction;
using reward::RewardInput;
using reward::RewardOutput;

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Runs in the forked child (async-signal-safe calls only): the network namespace.
bool isolate_network() {
  if (unshare(CLONE_NEWNET) == 0) return true;
  return unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0;  // unprivileged: inside a new user namespace
}

void set_limit(int resource, rlim_t soft, rlim_t hard) {
  struct rlimit rl{soft, hard};
  setrlimit(resource, &rl);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    std::string s = "was killed by signal " + std::to_string(sig);
    if (sig == SIGXCPU) s += " (SIGXCPU: its cpu_s limit)";
    if (sig == SIGKILL) s += " (SIGKILL: possibly its memory limit or the kernel's OOM killer)";
    return s;
  }
  return "ended (status " + std::to_string(status) + ")";
}

struct Worker {
  pid_t pid = -1;
  int fd = -1;  // our end of a socketpair: the child's stdin and stdout
  std::string pending;  // bytes read past the last answer line
  bool busy = false;
};

class CommandReward final : public RewardFunction {
 public:
  explicit CommandReward(ExternalRewardOptions o) : opt_(std::move(o)), workers_(static_cast<std::size_t>(opt_.workers)) {
    isolated_ = !opt_.network && network_isolation_available();
    if (!opt_.network && !isolated_)
      LS_LOG_WARN("reward", "reward {}: no network namespace can be created here (unshare refused); its command "
                            "runs with rlimits only and can reach the network", opt_.name);
  }
  ~CommandReward() override {
    std::lock_guard lk(mu_);
    for (auto& w : workers_) kill_worker(w);
  }

  std::string name() const override { return opt_.name; }
  bool parallel_members() const override { return true; }

  void shutdown() const override {
    std::lock_guard lk(mu_);
    closing_ = true;
    // Running calls notice within one poll slice and kill their own worker; idle ones go now.
    for (auto& w : workers_)
      if (!w.busy) kill_worker(w);
    cv_.notify_all();
  }

  RewardOutput score(const RewardInput& in) const override {
    const std::string line = reward_request_json(in) + "\n";
    Worker* w = acquire();
    struct Release {
      const CommandReward* self;
      Worker* w;
      ~Release() {
        std::lock_guard lk(self->mu_);
        w->busy = false;
        if (self->closing_) self->kill_worker(*w);
        self->cv_.notify_one();
      }
    } release{this, w};
    const bool fresh = w->pid < 0;
    const double allowed = opt_.timeout_s + (fresh ? opt_.startup_s : 0.0);
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(allowed));
    if (fresh) spawn(*w);
    send_line(*w, line, deadline);
    std::string answer = read_line(*w, deadline);
    RewardOutput out;
    out.reward = parse_reward_answer(answer, "reward " + opt_.name);
    out.reason = "external";
    out.components.push_back({opt_.name, out.reward, 1});
    return out;
  }

 private:
  Worker* acquire() const {
    std::unique_lock lk(mu_);
    for (;;) {
      if (closing_) throw RewardCallFailed(RewardFailure::kUnavailable, "reward " + opt_.name + ": shutting down");
      for (auto& w : workers_)
        if (!w.busy) {
          w.busy = true;
          return &w;
        }
      cv_.wait(lk);
    }
  }

  [[noreturn]] void fail(Worker& w, RewardFailure kind, const std::string& why) const {
    kill_worker(w);
    throw RewardCallFailed(kind, "reward " + opt_.name + ": " + why);
  }

  // Kills the worker's process group and reaps it; returns how it ended ("" if it was not running).
  std::string kill_worker(Worker& w) const {
    std::string how;
    if (w.pid > 0) {
      int status = 0;
      pid_t r = waitpid(w.pid, &status, WNOHANG);
      if (r == 0) {
        kill(-w.pid, SIGKILL);
        kill(w.pid, SIGKILL);
        waitpid(w.pid, &status, 0);
        how = "was killed";
      } else {
        how = describe_status(status);
        kill(-w.pid, SIGKILL);  // anything it left behind in its group
      }
    }
    if (w.fd >= 0) close(w.fd);
    w.pid = -1;
    w.fd = -1;
    w.pending.clear();
    return how;
  }

  void spawn(Worker& w) const {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
      throw RewardCallFailed(RewardFailure::kUnavailable, "reward " + opt_.name + ": socketpair: " + std::strerror(errno));
    int errpipe[2];
    if (pipe2(errpipe, O_CLOEXEC) != 0) {
      close(sv[0]);
      close(sv[1]);
      throw RewardCallFailed(RewardFailure::kUnavailable, "reward " + opt_.name + ": pipe: " + std::strerror(errno));
    }
    // Everything the child needs is prepared before fork: it may only make async-signal-safe calls.
    std::vector<char*> argv;
    for (const auto& a : opt_.command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const char* workdir = opt_.workdir.empty() ? nullptr : opt_.workdir.c_str();
    const bool isolate = isolated_;
    const rlim_t mem = static_cast<rlim_t>(opt_.memory_mb) << 20;
    const rlim_t cpu = static_cast<rlim_t>(std::max(1.0, std::ceil(opt_.cpu_s)));
    const pid_t pid = fork();
    if (pid < 0) {
      for (int fd : {sv[0], sv[1], errpipe[0], errpipe[1]}) close(fd);
      throw RewardCallFailed(RewardFailure::kUnavailable, "reward " + opt_.name + ": fork: " + std::strerror(errno));
    }
    if (pid == 0) {
      auto die = [&](int code) {
        int e = errno;
        ssize_t ignored = write(errpipe[1], &e, sizeof e);
        (void)ignored;
        _exit(code);
      };
      setpgid(0, 0);
      struct sigaction dfl{};
      dfl.sa_handler = SIG_DFL;
      for (int sig = 1; sig < NSIG; ++sig) sigaction(sig, &dfl, nullptr);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      if (dup2(sv[1], 0) < 0 || dup2(sv[1], 1) < 0) die(126);
      // Nothing of the trainer's (the ranks' store socket, connections, files) reaches the
      // reward's program; errpipe closes at exec as before.
      (void)close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
      if (isolate && !isolate_network()) die(126);
      set_limit(RLIMIT_AS, mem, mem);
      set_limit(RLIMIT_CPU, cpu, cpu + 1);
      set_limit(RLIMIT_CORE, 0, 0);
      set_limit(RLIMIT_NOFILE, 256, 256);
      set_limit(RLIMIT_FSIZE, rlim_t{256} << 20, rlim_t{256} << 20);
      if (workdir != nullptr && chdir(workdir) != 0) die(126);
      execvp(argv[0], argv.data());
      die(127);
    }
    close(sv[1]);
    close(errpipe[1]);
    int child_errno = 0;
    ssize_t n;
    do n = read(errpipe[0], &child_errno, sizeof child_errno);
    while (n < 0 && errno == EINTR);
    close(errpipe[0]);
    w.pid = pid;
    w.fd = sv[0];
    if (n > 0) {
      kill_worker(w);
      throw RewardCallFailed(RewardFailure::kUnavailable,
                             "reward " + opt_.name + ": cannot start '" + opt_.command[0] + "': " + std::strerror(child_errno));
    }
  }

  // Waits for `events` on the worker's socket until the deadline, in slices so that a shutdown
  // is noticed; fails the call (killing the worker) on timeout or shutdown.
  void wait_for(Worker& w, short events, Clock::time_point deadline) const {
    for (;;) {
      if (closing_.load()) fail(w, RewardFailure::kUnavailable, "shutting down");
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0)
        fail(w, RewardFailure::kTimeout, "no answer within " + fmt::format("{:g}", opt_.timeout_s) + " s (the worker was killed)");
      pollfd p{w.fd, events, 0};
      const int r = poll(&p, 1, static_cast<int>(std::min<long long>(left, 100)));
      if (r > 0) return;
      if (r < 0 && errno != EINTR) fail(w, RewardFailure::kCrashed, std::string("poll: ") + std::strerror(errno));
    }
  }

  void send_line(Worker& w, const std::string& line, Clock::time_point deadline) const {
    std::size_t off = 0;
    while (off < line.size()) {
      wait_for(w, POLLOUT, deadline);
      const ssize_t n = send(w.fd, line.data() + off, line.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) off += static_cast<std::size_t>(n);
      else if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      else crashed(w);
    }
  }

  std::string read_line(Worker& w, Clock::time_point deadline) const {
    for (;;) {
      const auto nl = w.pending.find('\n');
      if (nl != std::string::npos) {
        std::string out = w.pending.substr(0, nl);
        w.pending.erase(0, nl + 1);
        return out;
      }
      if (static_cast<std::int64_t>(w.pending.size()) > opt_.max_output_bytes)
        fail(w, RewardFailure::kInvalidOutput, "an answer longer than " + std::to_string(opt_.max_output_bytes) +
                                                   " bytes without a newline (the worker was killed)");
      wait_for(w, POLLIN, deadline);
      char buf[65536];
      const ssize_t n = recv(w.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) w.pending.append(buf, static_cast<std::size_t>(n));
      else if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      else crashed(w);
    }
  }

  [[noreturn]] void crashed(Worker& w) const {
    // The socket closed: give the process a moment to finish exiting so that its status is known.
    int status = 0;
    pid_t r = 0;
    for (int i = 0; i < 250 && (r = waitpid(w.pid, &status, WNOHANG)) == 0; ++i) usleep(2000);
    std::string how;
    if (r == w.pid) {
      how = describe_status(status);
      kill(-w.pid, SIGKILL);  // anything it left behind in its group
      w.pid = -1;
    }
    const std::string killed = kill_worker(w);
    if (how.empty()) how = killed.empty() ? "ended" : killed;
    throw RewardCallFailed(RewardFailure::kCrashed, "reward " + opt_.name + ": its worker " + how + " before answering");
  }

  ExternalRewardOptions opt_;
  bool isolated_ = false;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable std::vector<Worker> workers_;
  mutable std::atomic<bool> closing_{false};
};

}  // namespace

bool network_isolation_available() {
  static const bool ok = [] {
    const pid_t pid = fork();
    if (pid < 0) return false;
    if (pid == 0) _exit(isolate_network() ? 0 : 1);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }();
  return ok;
}

std::string reward_request_json(const RewardInput& in) {
  json j = {{"prompt", std::string(in.prompt)},
            {"completion", std::string(in.completion)},
            {"completion_ids", std::vector<std::int32_t>(in.completion_ids.begin(), in.completion_ids.end())},
            {"finish_reason", std::string(in.finish_reason)},
            {"references", in.references}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

double parse_reward_answer(const std::string& text, const std::string& who) {
  auto invalid = [&](const std::string& why) -> double {
    std::string shown = text.size() > 200 ? text.substr(0, 200) + "..." : text;
    throw RewardCallFailed(RewardFailure::kInvalidOutput, who + ": " + why + " (answer: " + json(shown).dump(-1, ' ', false, json::error_handler_t::replace) + ")");
  };
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) return invalid("the answer is not JSON");
  const json* v = &j;
  if (j.is_object()) {
    auto it = j.find("reward");
    if (it == j.end()) return invalid("the answer has no \"reward\"");
    v = &*it;
  }
  if (!v->is_number()) return invalid("the reward is not a number");
  const double r = v->get<double>();
  if (!std::isfinite(r) || r < 0 || r > 1) return invalid("the reward must be a finite number in [0, 1]");
  return r;
}

std::shared_ptr<const RewardFunction> make_http_reward(const ExternalRewardOptions& o);  // external_reward_http.cpp

std::shared_ptr<const RewardFunction> make_external_reward(const ExternalRewardOptions& o) {
  const std::string where = "rewards." + o.name;
  if (o.workers < 1) throw_invalid("{}.workers must be at least 1, got {}", where, o.workers);
  if (!(o.timeout_s > 0) || !std::isfinite(o.timeout_s)) throw_invalid("{}.timeout_s must be positive, got {}", where, o.timeout_s);
  if (o.max_output_bytes < 16) throw_invalid("{}.max_output_bytes must be at least 16, got {}", where, o.max_output_bytes);
  if (o.kind == "command") {
    if (o.command.empty() || o.command[0].empty()) throw_invalid("{}.command must name a program (a list: [\"python3\", \"score.py\"])", where);
    if (!(o.cpu_s > 0)) throw_invalid("{}.cpu_s must be positive, got {}", where, o.cpu_s);
    if (o.memory_mb < 16) throw_invalid("{}.memory_mb must be at least 16, got {}", where, o.memory_mb);
    if (!(o.startup_s >= 0)) throw_invalid("{}.startup_s must be >= 0, got {}", where, o.startup_s);
    return std::make_shared<CommandReward>(o);
  }
  if (o.kind == "http") return make_http_reward(o);
  throw_invalid("{}.kind must be \"command\" or \"http\", got \"{}\"", where, o.kind);
}

}  // namespace lorasync::rl
