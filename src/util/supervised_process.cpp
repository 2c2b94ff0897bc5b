#include "util/supervised_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

#include "util/error.h"
#include "util/files.h"

namespace lorasync {

namespace fs = std::filesystem;

namespace {
double mono_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

ChildProcess::ChildProcess(std::string name, std::vector<std::string> argv, const fs::path& dir,
                           std::vector<std::string> env, const std::atomic<int>* interrupt)
    : name_(std::move(name)), out_(dir / (name_ + ".out")), log_(dir / (name_ + ".log")), interrupt_(interrupt) {
  const int fo = ::open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int fe = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fo < 0 || fe < 0) {
    if (fo >= 0) ::close(fo);
    if (fe >= 0) ::close(fe);
    throw_env("cannot create the log files of {} in {}", name_, dir.string());
  }
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ < 0) {
    ::close(fo);
    ::close(fe);
    throw_env("fork failed for {}", name_);
  }
  if (pid_ == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(1);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::signal(SIGPIPE, SIG_DFL);
    ::dup2(fo, 1);
    ::dup2(fe, 2);
    const int fi = ::open("/dev/null", O_RDONLY);
    if (fi >= 0) ::dup2(fi, 0);
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(fo);
  ::close(fe);
}

void ChildProcess::reaped(int status, const struct rusage& ru) {
  exited_ = true;
  status_ = status;
  peak_rss_kb_ = ru.ru_maxrss;
  cpu_s_ = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + 1e-6 * static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

std::string ChildProcess::first_line(double timeout_s) {
  const double t0 = mono_s();
  while (mono_s() - t0 < timeout_s) {
    std::error_code ec;
    if (fs::exists(out_, ec)) {
      const std::string text = read_file(out_);
      const auto nl = text.find('\n');
      if (nl != std::string::npos) return text.substr(0, nl);
    }
    if (!alive()) break;
    if (interrupt_ && *interrupt_) throw Error(ErrorKind::kUnavailable, "interrupted");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw Error(ErrorKind::kUnavailable, name_ + " did not start (" + status_text() + "); see " + log_.string());
}

bool ChildProcess::alive() {
  if (exited_) return false;
  int st = 0;
  struct rusage ru {};
  const pid_t r = ::wait4(pid_, &st, WNOHANG, &ru);
  if (r == pid_) {
    reaped(st, ru);
    return false;
  }
  return true;
}

int ChildProcess::wait() {
  if (!exited_) {
    int st = 0;
    struct rusage ru {};
    while (::wait4(pid_, &st, 0, &ru) < 0 && errno == EINTR) {
      if (interrupt_ && *interrupt_) ::kill(pid_, SIGTERM);
    }
    reaped(st, ru);
  }
  return code();
}

int ChildProcess::code() const { return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_); }

std::string ChildProcess::status_text() const {
  if (!exited_) return "running";
  if (WIFEXITED(status_)) return "exit status " + std::to_string(WEXITSTATUS(status_));
  return "killed by signal " + std::to_string(WTERMSIG(status_));
}

void ChildProcess::signal(int sig) {
  if (alive()) ::kill(pid_, sig);
}

void ChildProcess::stop(double grace_s) {
  if (!alive()) return;
  ::kill(pid_, SIGTERM);
  const double t0 = mono_s();
  while (alive() && mono_s() - t0 < grace_s) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (alive()) {
    ::kill(pid_, SIGKILL);
    wait();
  }
}

}  // namespace lorasync
