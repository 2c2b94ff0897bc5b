// util/supervised_process.h: a supervised child process (`lorasync demo`, `lorasync bench e2e`).
//
// The child gets its own process group (a Ctrl-C reaches the parent, which decides what to stop),
// PR_SET_PDEATHSIG (it dies with the parent), stdin from /dev/null, stdout to DIR/NAME.out and
// stderr appended to DIR/NAME.log. Servers print their address as the first stdout line, read with
// first_line(). wait() and stop() collect the exit status and the child's peak RSS (wait4).
// An optional interrupt flag (set by the parent's signal handler) ends first_line() and wait()
// early: first_line() throws, wait() forwards SIGTERM to the child.
// Thread-safety: one thread per object.
#pragma once

#include <sys/resource.h>
#include <sys/types.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

namespace lorasync {

class ChildProcess {
 public:
  // Starts argv[0] (a path, not searched in PATH) with `env` ("NAME=value") added to this
  // process's environment. Throws EnvError when the log files cannot be created or fork fails.
  ChildProcess(std::string name, std::vector<std::string> argv, const std::filesystem::path& dir,
               std::vector<std::string> env = {}, const std::atomic<int>* interrupt = nullptr);
  ~ChildProcess() { stop(5.0); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // The first line of stdout, waiting up to timeout_s while the child lives; throws Unavailable
  // (naming the child, its status and its log) when there is none.
  std::string first_line(double timeout_s);
  bool alive();
  // Waits for the exit; returns the exit code (128 + signal when killed).
  int wait();
  int code() const;
  std::string status_text() const;
  void signal(int sig);
  // SIGTERM, then SIGKILL after grace_s.
  void stop(double grace_s);
  // The child's peak resident set in MiB once it has exited (0 before).
  double peak_rss_mb() const { return peak_rss_kb_ / 1024.0; }
  // User + system CPU seconds the child (and the children it waited for) used, once it has exited.
  double cpu_s() const { return cpu_s_; }
  pid_t pid() const { return pid_; }
  const std::string& name() const { return name_; }
  const std::filesystem::path& log() const { return log_; }
  const std::filesystem::path& out() const { return out_; }

 private:
  void reaped(int status, const struct rusage& ru);
  std::string name_;
  std::filesystem::path out_, log_;
  const std::atomic<int>* interrupt_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
  long peak_rss_kb_ = 0;
  double cpu_s_ = 0;
};

}  // namespace lorasync
