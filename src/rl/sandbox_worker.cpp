// One sandboxed worker process speaking lines over a socketpair (contracts in sandbox_worker.h).
#include "rl/sandbox_worker.h"

#include <fcntl.h>
#include <linux/close_range.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "reward/reward_fn.h"
#include "util/log.h"

namespace lorasync::rl {

using reward::RewardCallFailed;
using reward::RewardFailure;

namespace {

// Runs in the forked child (async-signal-safe calls only): the network namespace.
bool isolate_network() {
  if (unshare(CLONE_NEWNET) == 0) return true;
  return unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0;  // unprivileged: inside a new user namespace
}

void set_limit(int resource, rlim_t soft, rlim_t hard) {
  struct rlimit rl{soft, hard};
  setrlimit(resource, &rl);
}

}  // namespace

std::string describe_exit_status(int status) {
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

SandboxOptions sandbox_options(std::string who, std::vector<std::string> command, std::string workdir, double cpu_s,
                               std::int64_t memory_mb, std::int64_t max_line_bytes, bool network) {
  SandboxOptions o;
  o.who = std::move(who);
  o.command = std::move(command);
  o.workdir = std::move(workdir);
  o.cpu_s = cpu_s;
  o.memory_mb = memory_mb;
  o.max_line_bytes = max_line_bytes;
  o.isolate_network = !network && network_isolation_available();
  if (!network && !o.isolate_network)
    LS_LOG_WARN("trainer", "{}: no network namespace can be created here (unshare refused); its program runs with rlimits "
                           "only and can reach the network", o.who);
  return o;
}

std::string SandboxWorker::kill() {
  std::string how;
  if (pid_ > 0) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == 0) {
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      how = "was killed";
    } else {
      how = describe_exit_status(status);
      ::kill(-pid_, SIGKILL);  // anything it left behind in its group
    }
  }
  if (fd_ >= 0) close(fd_);
  pid_ = -1;
  fd_ = -1;
  pending_.clear();
  return how;
}

void SandboxWorker::fail(RewardFailure kind, const std::string& why) {
  kill();
  throw RewardCallFailed(kind, opt_.who + ": " + why);
}

void SandboxWorker::start(const SandboxOptions& opt) {
  kill();
  opt_ = opt;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    throw RewardCallFailed(RewardFailure::kUnavailable, opt_.who + ": socketpair: " + std::strerror(errno));
  int errpipe[2];
  if (pipe2(errpipe, O_CLOEXEC) != 0) {
    close(sv[0]);
    close(sv[1]);
    throw RewardCallFailed(RewardFailure::kUnavailable, opt_.who + ": pipe: " + std::strerror(errno));
  }
  // Everything the child needs is prepared before fork: it may only make async-signal-safe calls.
  std::vector<char*> argv;
  for (const auto& a : opt_.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; e && *e; ++e) env_strings.emplace_back(*e);
  for (const auto& e : opt_.env) {
    const auto eq = e.find('=');
    const std::string name = e.substr(0, eq);
    env_strings.erase(std::remove_if(env_strings.begin(), env_strings.end(),
                                     [&](const std::string& s) { return s.compare(0, name.size() + 1, name + "=") == 0; }),
                      env_strings.end());
    env_strings.push_back(e);
  }
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const char* workdir = opt_.workdir.empty() ? nullptr : opt_.workdir.c_str();
  const bool isolate = opt_.isolate_network;
  const rlim_t mem = static_cast<rlim_t>(opt_.memory_mb) << 20;
  const rlim_t cpu = static_cast<rlim_t>(std::max(1.0, std::ceil(opt_.cpu_s)));
  const pid_t pid = fork();
  if (pid < 0) {
    for (int fd : {sv[0], sv[1], errpipe[0], errpipe[1]}) close(fd);
    throw RewardCallFailed(RewardFailure::kUnavailable, opt_.who + ": fork: " + std::strerror(errno));
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
    // program; errpipe closes at exec as before.
    (void)close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
    if (isolate && !isolate_network()) die(126);
    set_limit(RLIMIT_AS, mem, mem);
    set_limit(RLIMIT_CPU, cpu, cpu + 1);
    set_limit(RLIMIT_CORE, 0, 0);
    set_limit(RLIMIT_NOFILE, 256, 256);
    set_limit(RLIMIT_FSIZE, rlim_t{256} << 20, rlim_t{256} << 20);
    if (workdir != nullptr && chdir(workdir) != 0) die(126);
    execvpe(argv[0], argv.data(), envp.data());
    die(127);
  }
  close(sv[1]);
  close(errpipe[1]);
  int child_errno = 0;
  ssize_t n;
  do n = read(errpipe[0], &child_errno, sizeof child_errno);
  while (n < 0 && errno == EINTR);
  close(errpipe[0]);
  pid_ = pid;
  fd_ = sv[0];
  if (n > 0) {
    kill();
    throw RewardCallFailed(RewardFailure::kUnavailable, opt_.who + ": cannot start '" + opt_.command[0] + "': " + std::strerror(child_errno));
  }
}

// Waits for `events` on the socket until the deadline, in slices so that `closing` is noticed.
void SandboxWorker::wait_for(short events, Clock::time_point deadline, double timeout_s, const std::atomic<bool>* closing) {
  for (;;) {
    if (closing && closing->load()) fail(RewardFailure::kUnavailable, "shutting down");
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) fail(RewardFailure::kTimeout, fmt::format("no answer within {:g} s (the worker was killed)", timeout_s));
    pollfd p{fd_, events, 0};
    const int r = poll(&p, 1, static_cast<int>(std::min<long long>(left, 100)));
    if (r > 0) return;
    if (r < 0 && errno != EINTR) fail(RewardFailure::kCrashed, std::string("poll: ") + std::strerror(errno));
  }
}

void SandboxWorker::send_line(const std::string& line, Clock::time_point deadline, double timeout_s, const std::atomic<bool>* closing) {
  std::size_t off = 0;
  while (off < line.size()) {
    wait_for(POLLOUT, deadline, timeout_s, closing);
    const ssize_t n = send(fd_, line.data() + off, line.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) off += static_cast<std::size_t>(n);
    else if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    else crashed();
  }
}

std::string SandboxWorker::read_line(Clock::time_point deadline, double timeout_s, const std::atomic<bool>* closing) {
  std::size_t scanned = 0;
  for (;;) {
    const auto nl = pending_.find('\n', scanned);
    if (nl != std::string::npos) {
      std::string out = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      return out;
    }
    scanned = pending_.size();
    if (static_cast<std::int64_t>(pending_.size()) > opt_.max_line_bytes)
      fail(RewardFailure::kInvalidOutput,
           "an answer longer than " + std::to_string(opt_.max_line_bytes) + " bytes without a newline (the worker was killed)");
    wait_for(POLLIN, deadline, timeout_s, closing);
    char buf[65536];
    const ssize_t n = recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) pending_.append(buf, static_cast<std::size_t>(n));
    else if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    else crashed();
  }
}

void SandboxWorker::crashed() {
  // The socket closed: give the process a moment to finish exiting so that its status is known.
  int status = 0;
  pid_t r = 0;
  for (int i = 0; i < 250 && (r = waitpid(pid_, &status, WNOHANG)) == 0; ++i) usleep(2000);
  std::string how;
  if (r == pid_) {
    how = describe_exit_status(status);
    ::kill(-pid_, SIGKILL);  // anything it left behind in its group
    pid_ = -1;
  }
  const std::string killed = kill();
  if (how.empty()) how = killed.empty() ? "ended" : killed;
  throw RewardCallFailed(RewardFailure::kCrashed, opt_.who + ": its worker " + how + " before answering");
}

}  // namespace lorasync::rl
