// tests/util/child_process.h: start the lorasync binary as a child process (fork/exec), read its
// stdout line by line (e.g. the {"event": "listening", "port": N} line of serve), stop it with a
// signal. The child is killed on destruction. stderr goes to a file for failure messages.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "util/files.h"

namespace lorasync::testing {

class ChildProcess {
 public:
  explicit ChildProcess(std::vector<std::string> argv, std::vector<std::string> env = {})
      : err_path_(fs::temp_directory_path() / ("lorasync-child-" + random_hex(6) + ".err")) {
    int out[2];
    if (pipe(out) != 0) std::abort();
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      int e = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (e >= 0) dup2(e, 2);
      ::close(out[0]);
      for (const auto& kv : env) putenv(const_cast<char*>(kv.c_str()));
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    ::close(out[1]);
    out_fd_ = out[0];
  }
  ~ChildProcess() {
    kill(SIGKILL);
    wait_exit(10);
    if (out_fd_ >= 0) ::close(out_fd_);
    std::error_code ec;
    fs::remove(err_path_, ec);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }

  // Next stdout line within `timeout_s`, or nullopt (timeout or EOF).
  std::optional<std::string> read_line(double timeout_s) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0) return std::nullopt;
      pollfd p{out_fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char tmp[4096];
      ssize_t n = ::read(out_fd_, tmp, sizeof tmp);
      if (n <= 0) return std::nullopt;
      buf_.append(tmp, static_cast<std::size_t>(n));
    }
  }

  void kill(int sig) {
    if (pid_ > 0 && !exited_) ::kill(pid_, sig);
  }
  // Exit status (or 128 + signal) within timeout_s, else nullopt.
  std::optional<int> wait_exit(double timeout_s) {
    if (exited_) return status_;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < deadline) {
      int st = 0;
      pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return status_;
      }
      usleep(10000);
    }
    return std::nullopt;
  }
  std::string stderr_text() const {
    try {
      return read_file(err_path_);
    } catch (...) {
      return "";
    }
  }

 private:
  fs::path err_path_;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string buf_;
  bool exited_ = false;
  int status_ = -1;
};

}  // namespace lorasync::testing
