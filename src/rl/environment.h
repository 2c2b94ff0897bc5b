// rl/environment.h: multi-turn environments through protocol v1 (docs/environments.md): a pool of
// sandboxed worker processes (rl/sandbox_worker.h) running the program of `env.command`, one
// episode per worker at a time, many episodes one after another.
//
//   -> {"lorasync_env": 1, "id": N, "op": "reset", "row": {...}, "seed": S}
//   <- {"id": N, "observation": OBS, "done": false, "info": {...}}
//   -> {"lorasync_env": 1, "id": N, "op": "step", "action": {"text": str, "token_ids": [int],
//       "finish_reason": "stop" | "length"}}
//   <- {"id": N, "observation": OBS | null, "reward": number, "done": bool, "info": {...}}
//   OBS = {"messages": [{"role": "system" | "user" | "tool", "content": str}, ...]}
//       | {"token_ids": [int, ...]}
//   <- {"id": N, "error": str}   the environment's own failure: the episode fails, the worker stays
//
// Every exchange has a hard deadline (`timeout_s`, plus `startup_s` for an exchange that starts
// its worker). A worker that times out, crashes, prints something that is not a well-formed answer
// (not JSON, the wrong id, a wrong type, an answer line over max_output_bytes) is killed; the next
// episode gets a fresh one, so an answer that comes late is never read as the next one's (the
// desynchronised-socket failure of environments reused after a client timeout). Each failure is an
// EnvFailed of one kind, counted by the caller as rollout/env_<kind>_total, and costs that episode
// only: other episodes hold other workers.
// Thread-safety: open() and shutdown() from any thread; a Session is used by one thread at a time.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "rl/sandbox_worker.h"

namespace lorasync::rl {

inline constexpr int kEnvProtocol = 1;

struct EnvOptions {
  std::vector<std::string> command;
  std::string workdir;
  std::vector<std::string> environment;  // "NAME=value"
  std::int64_t workers = 8;
  double timeout_s = 30, startup_s = 60, cpu_s = 3600;
  std::int64_t memory_mb = 4096;
  bool network = false;
  std::int64_t max_output_bytes = 4 << 20;
};

enum class EnvFailure { kTimeout, kCrashed, kInvalid, kError, kUnavailable };
const char* env_failure_name(EnvFailure f);  // "timeout", "crashed", "invalid", "error", "unavailable"

class EnvFailed : public std::runtime_error {
 public:
  EnvFailed(EnvFailure kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  EnvFailure kind() const { return kind_; }

 private:
  EnvFailure kind_;
};

struct EnvMessage {
  std::string role, content;
};

struct Observation {
  bool tokens = false;                   // token_ids given (appended verbatim) instead of messages
  std::vector<EnvMessage> messages;
  std::vector<std::int64_t> token_ids;
};

struct EnvAction {
  std::string text;                      // the model's turn, decoded, a trailing stop token left out
  std::vector<std::int64_t> token_ids;   // as sampled
  std::string finish_reason;             // "stop" | "length"
};

struct EnvStepResult {
  bool has_observation = false;
  Observation observation;
  double reward = 0;
  bool done = false;
  std::string info;                      // the answer's "info" object, as JSON ("" when absent)
};

// Parsers of one answer line (exposed for the fuzz target and the unit tests): EnvFailed
// {kInvalid} naming what was wrong, {kError} for an {"error": ...} answer.
Observation parse_reset_answer(const std::string& line, std::int64_t id);
EnvStepResult parse_step_answer(const std::string& line, std::int64_t id);

class EnvironmentPool {
 public:
  explicit EnvironmentPool(EnvOptions opt);
  ~EnvironmentPool();

  // One worker, held for one episode; given back when destroyed (killed when it failed).
  class Session {
   public:
    ~Session();
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
    // row_json: the task row as a JSON object. Throws EnvFailed.
    Observation reset(const std::string& row_json, std::int64_t seed);
    EnvStepResult step(const EnvAction& action);

   private:
    friend class EnvironmentPool;
    Session(EnvironmentPool* pool, std::size_t slot) : pool_(pool), slot_(slot) {}
    std::string exchange(const std::string& request);
    EnvironmentPool* pool_;
    std::size_t slot_;
    std::int64_t next_id_ = 1;
  };

  // Waits for a free worker; EnvFailed{kUnavailable} after shutdown().
  std::unique_ptr<Session> open();
  // Kills every worker; running exchanges fail with kUnavailable within 100 ms.
  void shutdown();
  std::int64_t workers_started() const { return started_.load(); }

 private:
  struct Slot {
    SandboxWorker proc;
    bool busy = false;
  };
  EnvOptions opt_;
  SandboxOptions sandbox_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  std::atomic<bool> closing_{false};
  std::atomic<std::int64_t> started_{0};
};

}  // namespace lorasync::rl
