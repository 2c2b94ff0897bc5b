// rl/external_reward.h: rewards computed outside the trainer, with hard deadlines (the scorer's
// external functions; the reward interface is reward/reward_fn.h).
//
//   kind = "command": a pool of long-lived worker processes running `command` (argv, no shell).
//     Protocol, one JSON line each way per completion (UTF-8, '\n'-terminated):
//       -> {"prompt": str, "completion": str, "completion_ids": [int], "finish_reason": str,
//           "references": [str]}
//       <- {"reward": number} (or a bare number), finite and in [0, 1]
//     Each worker is sandboxed when it starts: its own process group, its own network namespace
//     (no interfaces; where the kernel allows it, see network_isolation_available()) unless
//     `network = true`, and rlimits always: address space `memory_mb`, CPU seconds `cpu_s` over
//     the worker's life (SIGXCPU kills it; a new worker takes its place), no core files, at most
//     256 open files and 256 MiB per written file. stderr is the trainer's. When the trainer
//     exits, a worker reads end of input and should exit; it is killed on shutdown().
//   kind = "http": POST the same JSON to `url`; the answer body is the same as a worker's line.
//     A bearer token can come from the environment variable `bearer_token_env`.
//
// Every call has a hard deadline, `timeout_s` from the moment a worker (or a connection slot) is
// free to run it (plus `startup_s` when the call has to start a new worker process first): past it the worker's whole process group is killed with SIGKILL (a new one is
// started on the next call) or the HTTP request is abandoned, and score() throws
// RewardCallFailed{kTimeout}. A worker that exits or is killed mid-call gives kCrashed; an answer
// that is not a reward gives kInvalidOutput (the worker is kept when the line was well-framed).
// At most `workers` calls run at once; other callers wait for a free worker (each running call
// ends by its deadline). shutdown() kills every worker and fails every waiting or running call
// at once with kUnavailable.
// Thread model: score() and shutdown() may be called from any thread, concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reward/reward_fn.h"
#include "rl/sandbox_worker.h"

namespace lorasync::rl {

struct ExternalRewardOptions {
  std::string name;                  // the reward's name in grpo.reward_funcs and in logs
  std::string kind;                  // "command" | "http"
  std::vector<std::string> command;  // command: argv (argv[0] searched in PATH)
  std::string workdir;               // command: working directory ("" = the trainer's)
  std::string url;                   // http: the endpoint to POST to
  std::string bearer_token_env;      // http: environment variable holding a bearer token
  std::int64_t workers = 4;          // concurrent calls (processes, or HTTP requests)
  double timeout_s = 10;             // hard deadline per call
  double startup_s = 30;             // command: added to the deadline of a call that starts its worker
  double cpu_s = 600;                // command: CPU seconds per worker process (RLIMIT_CPU)
  std::int64_t memory_mb = 2048;     // command: address space per worker (RLIMIT_AS)
  bool network = false;              // command: false = its own, empty network namespace
  std::int64_t max_output_bytes = 1 << 20;  // the longest answer accepted
};

// InvalidInput naming the option for a malformed configuration (empty command, unknown kind,
// a URL that does not parse, non-positive workers or timeout).
std::shared_ptr<const reward::RewardFunction> make_external_reward(const ExternalRewardOptions& options);

// network_isolation_available() is in rl/sandbox_worker.h (the workers' sandbox).

// The JSON line sent for one completion (without the trailing newline).
std::string reward_request_json(const reward::RewardInput& input);

// Parses one answer: {"reward": x} or a bare number, finite and in [0, 1]; RewardCallFailed
// {kInvalidOutput} naming what was wrong otherwise (`who` prefixes the message).
double parse_reward_answer(const std::string& text, const std::string& who);

}  // namespace lorasync::rl
