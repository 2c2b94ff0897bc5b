// rl/pipeline.h: the trainer's rollout side (trainer.md §1): dispatch cursor, admission, the async
// HTTP rollout client, the scoring pool, the bounded rollout queue, staleness and the version table.
//
// Threads: one rollout thread runs an io_context with a dispatcher coroutine and one coroutine per
// group request (n = G, token-id prompts, return_token_ids, logprobs 0) over one keep-alive pool;
// `score_workers` threads score finished groups and push them, with advantages, into the queue.
// The trainer pops groups; the sync thread switches versions. All shared state sits behind one
// mutex, held only for short critical sections.
//
// Staleness is counted in sync indices (k), never in version numbers: after a resume the version
// numbers jump while k does not. A group is stale iff k(V) - k(v) > max_staleness.
// Thread-safety: every public member is thread-safe.
#pragma once

#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rl/config.h"
#include "rl/dataset.h"
#include "rl/rollout_types.h"

namespace lorasync::tok {
class Tokenizer;
}
namespace lorasync::reward {
class RewardFunction;
}

namespace lorasync::rl {

// Dispatch order (trainer.md §1.6): the redo list first, then the epoch's permutation.
struct Cursor {
  std::int64_t epoch = 0, position = 0;
  std::vector<std::int64_t> permutation;  // indices into Dataset::problems
  std::deque<PromptRef> redo;
};

// Per-step window sums, reset when the trainer reads them.
struct WindowStats {
  double backpressure_s = 0, score_block_s = 0, admission_block_s = 0;
  double request_s_sum = 0, score_s_sum = 0;
  std::int64_t requests = 0, scored_groups = 0, generated_tokens = 0;
};

// One line of groups.jsonl (trainer.md §6).
struct GroupEvent {
  std::string disposition;  // trained | dropped_stale | cancelled | failed | abandoned
  PromptRef prompt;
  std::int64_t version = 0, sync_index = 0, staleness = 0, tokens = 0;
  double mean_reward = 0;
};

// Everything of the pipeline a checkpoint holds.
struct PipelineState {
  Cursor cursor;                   // redo list includes prompts in flight at capture time
  std::vector<Group> groups;       // queued (scored) and in scoring (scored = false)
  std::map<std::string, std::int64_t> counters;
  std::vector<VersionInfo> versions;
  std::int64_t current = 0;        // current version number
  std::int64_t samples_since_switch = 0;
  std::uint64_t events_offset = 0;  // the event log's offset, read in the same critical section
};

struct PipelineOptions {
  TrainConfig cfg;
  std::string server_url, api_key;
  std::int64_t vocab = 0;
  std::vector<std::int64_t> stop_ids;
  std::string prefix;              // adapter name prefix
};

class Pipeline {
 public:
  using EventSink = std::function<void(const GroupEvent&)>;
  Pipeline(PipelineOptions opt, const Dataset& data, const tok::Tokenizer& tokenizer,
           std::shared_ptr<const reward::RewardFunction> reward, EventSink sink);
  ~Pipeline();

  // Fresh cursor for epoch 0 (or restores one) before start().
  void init_fresh();
  void restore(PipelineState state);
  void start();
  // Stops dispatch, aborts requests in flight (their prompts go to the redo list), joins threads.
  void stop();

  // async.ordered (trainer.md §1): the trainer allows the dispatch of one step's samples at a time
  // (less what is already queued, scoring or in flight) and pop() hands groups out in dispatch
  // order, so a step's groups, their versions and their order do not depend on timing. Without
  // async.ordered, a no-op.
  void grant(std::int64_t samples);
  // Trainer: the next group in queue order; waits up to timeout_s. nullopt on timeout, on a
  // fatal error (see fatal()) or when the run is exhausted (exhausted()).
  std::optional<Group> pop(double timeout_s);
  // Puts groups of an abandoned partial step back at the front of the queue.
  void unpop(std::vector<Group> groups);
  // Drop a group as stale (counted; requeued or abandoned).
  void drop_stale(const Group& g, std::int64_t staleness);
  void record_trained(const std::vector<Group>& groups);
  std::int64_t staleness_of(const Group& g) const;
  bool exhausted() const;  // data.epochs reached and nothing left anywhere

  // Versions (sync thread).
  void add_version(const VersionInfo& v);
  // V := v; c := 0; cancels in-flight groups and removes queued ones beyond the staleness bound.
  void switch_to(std::int64_t version);
  bool in_flight_uses(std::int64_t version) const;
  // The version was unloaded everywhere: forgotten, so a later 404 naming it is fatal (no request
  // may use it any more) and the table stays bounded over a long run.
  void retire_version(std::int64_t version);
  std::optional<VersionInfo> version(std::int64_t v) const;
  std::optional<VersionInfo> current() const;

  // Read inside capture()'s critical section: the event sink's log offset (the sink runs under
  // the same lock, so the offset matches the captured state exactly).
  void set_event_offset(std::function<std::uint64_t()> f);
  // Snapshot for a checkpoint (one critical section).
  PipelineState capture() const;

  std::int64_t queue_samples() const;
  std::int64_t inflight_sequences() const;
  std::map<std::string, std::int64_t> counters() const;
  void add_counter(const std::string& name, std::int64_t delta);
  WindowStats take_window();
  double seconds_since_success() const;
  std::optional<std::string> fatal() const;  // a fatal pipeline error (config error from a server)
  double dispatched_fraction() const;         // epoch + position / dataset size

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Per-epoch permutation of n prompt positions seeded by (seed, epoch); identity without shuffle.
std::vector<std::int64_t> epoch_permutation(std::int64_t n, std::int64_t seed, std::int64_t epoch, bool shuffle);
// Every random choice of the trainer (the epoch permutations, request seeds) is a pure function of
// (seed, epoch, prompt, attempt) through splitmix64 (util/random.h): the trainer keeps no generator
// state, so a checkpoint's seed and cursor restore them all.

}  // namespace lorasync::rl
