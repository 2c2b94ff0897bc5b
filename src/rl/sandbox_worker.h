// rl/sandbox_worker.h: one sandboxed, long-lived worker process that speaks newline-terminated
// lines over a socketpair (its stdin and stdout; stderr stays the trainer's). The command rewards
// (external_reward.h) and the environments (environment.h) run their programs through it.
//
// Sandbox, applied in the child before exec: its own process group; its own, empty network
// namespace when `isolate_network` (see network_isolation_available()); rlimits: address space
// `memory_mb`, CPU seconds `cpu_s` over the process's life (SIGXCPU), no core files, 256 open
// files, 256 MiB per written file; no descriptor of the trainer's besides the socket.
//
// Every call has a hard deadline: past it the whole process group is killed with SIGKILL and the
// call throws reward::RewardCallFailed{kTimeout}. A process that exits or closes its end mid-call
// gives kCrashed (with how it ended), a line longer than `max_line_bytes` gives kInvalidOutput
// (killed too), a set `closing` flag gives kUnavailable within 100 ms. After any throw the process
// is gone (running() is false): a worker is never reused after a failed exchange, so an answer
// that arrives late can never be read as the answer to the next request. Messages start with `who`.
// Thread-safety: one thread at a time per worker (the owner); `closing` may be set from any thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace lorasync::reward {
enum class RewardFailure;  // reward/reward_fn.h
}

namespace lorasync::rl {

struct SandboxOptions {
  std::string who;                   // message prefix: "reward exact", "env"
  std::vector<std::string> command;  // argv (argv[0] searched in PATH)
  std::string workdir;               // "" = the trainer's
  std::vector<std::string> env;      // extra environment variables, "NAME=value"
  double cpu_s = 600;
  std::int64_t memory_mb = 2048;
  bool isolate_network = true;
  std::int64_t max_line_bytes = 1 << 20;
};

// The options of a worker: isolate_network is set when `network` is false and this process can
// make a namespace; when it cannot, a warning says that `who`'s program can reach the network.
SandboxOptions sandbox_options(std::string who, std::vector<std::string> command, std::string workdir, double cpu_s,
                               std::int64_t memory_mb, std::int64_t max_line_bytes, bool network);

class SandboxWorker {
 public:
  using Clock = std::chrono::steady_clock;
  SandboxWorker() = default;
  SandboxWorker(const SandboxWorker&) = delete;
  SandboxWorker& operator=(const SandboxWorker&) = delete;
  ~SandboxWorker() { kill(); }

  bool running() const { return pid_ > 0; }
  // Starts the process; kUnavailable when it cannot be started (naming the program and errno).
  void start(const SandboxOptions& opt);
  // Writes `line` (which must end with '\n') / reads one line (without its '\n').
  void send_line(const std::string& line, Clock::time_point deadline, double timeout_s, const std::atomic<bool>* closing);
  std::string read_line(Clock::time_point deadline, double timeout_s, const std::atomic<bool>* closing);
  // Kills the process group and reaps it; returns how it ended ("" when it was not running).
  std::string kill();

 private:
  [[noreturn]] void fail(reward::RewardFailure kind, const std::string& why);
  [[noreturn]] void crashed();
  void wait_for(short events, Clock::time_point deadline, double timeout_s, const std::atomic<bool>* closing);

  SandboxOptions opt_;
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string pending_;  // bytes read past the last line
};

// Whether this process may give a child its own network namespace (unshare(CLONE_NEWNET),
// directly or inside a new user namespace). Probed once by forking a child.
bool network_isolation_available();

// How a wait status reads: "exited with status 3", "was killed by signal 9 (SIGKILL: ...)".
std::string describe_exit_status(int status);

}  // namespace lorasync::rl
