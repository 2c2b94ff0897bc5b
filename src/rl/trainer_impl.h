// rl/trainer_impl.h: the Trainer behind run_trainer (trainer.h), shared by its translation units:
// trainer.cpp (set-up, capability probe, the run loop), trainer_sync.cpp (the sync thread:
// publish, load, switch, unload, retention), trainer_step.cpp (step assembly, the GRPO step and
// its metrics, the console line) and trainer_checkpoint.cpp (checkpoint write and restore).
// Private to src/rl: it pulls in libtorch and the whole pipeline.
// Thread-safety: see trainer.h; the sync_* members are guarded by sync_mu_.
#pragma once

#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "core/io/adapter_manifest.h"
#include "core/io/checkpoint_dir.h"
#include "core/model/lora.h"
#include "core/model/decoder_model.h"
#include "core/model/runtime.h"
#include "core/tokenizer/tokenizer.h"
#include "http/blocking_client.h"
#include "reward/reward_fn.h"
#include "rl/checkpoint.h"
#include "rl/config.h"
#include "rl/dataset.h"
#include "rl/dist.h"
#include "rl/grpo_loss.h"
#include "rl/metrics_endpoint.h"
#include "rl/optimizer.h"
#include "rl/packed_forward.h"
#include "rl/packing.h"
#include "rl/pipeline.h"
#include "rl/publisher.h"
#include "rl/step_work.h"
#include "rl/trainer.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/process.h"
#include "util/sha256.h"

#ifndef LORASYNC_VERSION
#define LORASYNC_VERSION "0.1.0"
#endif

namespace lorasync::rl::detail {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

inline double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }
inline double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Exit-code carrying errors.
struct ConfigRefusal : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct Preempted {};

[[noreturn]] inline void refuse(const std::string& msg) { throw ConfigRefusal(msg); }

// Appends lines to a JSONL file; byte offset for checkpoints.
class JsonlWriter {
 public:
  void open(const fs::path& p) {
    std::lock_guard lk(mu_);
    path_ = p;
    f_ = std::fopen(p.c_str(), "ab");
    if (!f_) throw_env("cannot open {} for appending", p.string());
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    logical_ = ec ? 0 : static_cast<std::uint64_t>(size);
  }
  ~JsonlWriter() {
    flush();
    if (f_) std::fclose(f_);
  }
  void write(const std::string& line) {
    std::lock_guard lk(mu_);
    if (!f_) return;
    std::fwrite(line.data(), 1, line.size(), f_);
    std::fputc('\n', f_);
    std::fflush(f_);
  }
  std::uint64_t offset() {
    std::lock_guard lk(mu_);
    if (!f_) return 0;
    std::fflush(f_);
    ::fsync(fileno(f_));
    return static_cast<std::uint64_t>(std::ftell(f_));
  }

  // Buffered mode (groups.jsonl): append() only copies the line into memory, so a caller holding
  // another lock (the pipeline's) never waits on the disk; logical_offset() counts what was
  // appended, written or not, so it is consistent with the caller's state under that lock;
  // flush() writes the buffer out (called between steps and before a checkpoint).
  void append(const std::string& line) {
    std::lock_guard lk(mu_);
    if (!f_) return;
    pending_ += line;
    pending_ += '\n';
    logical_ += line.size() + 1;
  }
  std::uint64_t logical_offset() {
    std::lock_guard lk(mu_);
    return logical_;
  }
  void flush() {
    std::lock_guard flk(flush_mu_);  // one writer at a time, in append order
    std::string out;
    std::FILE* f;
    {
      std::lock_guard lk(mu_);
      out.swap(pending_);
      f = f_;
    }
    if (!f || out.empty()) return;
    std::fwrite(out.data(), 1, out.size(), f);
    std::fflush(f);
    ::fsync(fileno(f));
  }

 private:
  std::mutex flush_mu_, mu_;
  fs::path path_;
  std::FILE* f_ = nullptr;
  std::string pending_;
  std::uint64_t logical_ = 0;  // file size at open + bytes appended since
};

class Trainer {
 public:
  // dist: rank 0 of a data-parallel run (docs/trainer.md "Data-parallel ranks"), or none.
  Trainer(const TrainArgs& args, std::optional<DistEnv> dist) : args_(args), dist_env_(std::move(dist)) {}
  int run();

 private:
  int run_main();
  // ---- set-up
  void resolve_config();
  void prepare_output();
  void load_model_and_data();
  void wait_for_server();
  void probe_capabilities();
  void unload_leftovers(const std::set<std::int64_t>& keep);
  // ---- sync
  struct SyncJob {
    std::int64_t version = 0, sync_index = 0, step = 0;
    model::LoraAdapter snapshot;
  };
  struct SyncDone {
    std::int64_t version = 0;
    double save_s = 0, publish_s = 0, load_s = 0, total_s = 0;
  };
  void sync_thread_main();
  void run_sync(SyncJob& job);
  void load_adapter(const std::string& name, const fs::path& dir);
  void push_adapter(const Published& p);
  bool unload_adapter(const std::string& name);
  // Unloads the loaded versions beyond the staleness window of `sync_index` (not `keep`) once no
  // request uses them, waiting up to `drain_wait_s` for the cancelled ones to end.
  void retire_versions(std::int64_t keep, std::int64_t sync_index, double drain_wait_s);
  void start_sync(std::int64_t step, const model::LoraAdapter* snapshot = nullptr);
  double wait_sync_idle();
  // ---- training
  void train_step(std::vector<Group>& groups, json& m);
  // episodes.jsonl: one line per trained episode (its turns' text, reward, how it ended).
  void log_episodes(const std::vector<Group>& groups);
  std::vector<Group> assemble_step(double& wait_s);
  std::vector<Group> assemble_step_into(std::vector<Group>& groups, double& wait_s);
  void write_checkpoint_now(bool final_ckpt);
  void restore_from(const fs::path& dir);
  void emit_metrics(json& m);
  void console(const json& m);
  void shutdown_pipeline();
  double lr_at(std::int64_t step) const;
  // ---- data-parallel ranks (trainer_dp.cpp): rank 0's side of the protocol
  void dp_send_config();             // checks the rank count against the configuration, sends it
  void dp_send_init();               // the adapter and optimizer state, once they exist
  void dp_send_step(StepWork& w);    // this step's work, with the snapshots the ranks lack
  void dp_finish(const std::string& kind, const std::string& message) noexcept;  // stop | abort
  void dp_check_peers();             // throws naming a rank whose heartbeat stopped
  void dp_post(const std::string& bytes);              // the next message
  std::string dp_failure(const std::vector<int>& ranks);  // "rank 1 failed in step 3: ..."

  TrainArgs args_;
  TrainConfig cfg_;
  fs::path out_, ckpt_dir_, adapters_dir_;
  std::unique_ptr<model::DecoderModel> model_;
  std::optional<tok::Tokenizer> tokenizer_;
  Dataset data_;
  c10::Device device_{c10::kCPU};
  model::LoraAdapter adapter_;
  std::unique_ptr<AdamW> opt_;
  std::shared_ptr<const reward::RewardFunction> reward_;
  std::vector<std::string> reward_names_;
  std::unique_ptr<Pipeline> pipe_;
  std::unique_ptr<AdapterPublisher> publisher_;
  std::unique_ptr<http::BlockingClient> client_;  // main thread
  std::unique_ptr<MetricsEndpoint> endpoint_;
  JsonlWriter metrics_, groups_log_, episodes_log_;  // episodes.jsonl: with an [env] command
  std::string served_model_, base_sha_;
  bool push_ = false;  // weight sync by push (probe_capabilities)
  std::vector<std::int64_t> stop_ids_;
  LossConfig loss_cfg_;
  LossAgg agg_ = LossAgg::kSeqSumConst;

  std::int64_t step_ = 0, restarts_ = 0, next_version_ = 1;
  std::atomic<std::int64_t> event_step_{0};
  double loss_scale_ = 1.0;
  std::int64_t clean_steps_ = 0;
  std::map<std::int64_t, model::LoraAdapter> version_adapters_;  // window, for recompute
  std::optional<std::int64_t> pending_sync_version_;               // restored pending sync

  // Sync thread state.
  std::thread sync_thread_;
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  std::optional<SyncJob> sync_job_;
  bool sync_busy_ = false, sync_quit_ = false;
  std::vector<SyncDone> sync_done_;
  std::optional<std::string> sync_error_;
  std::set<std::int64_t> loaded_;           // versions loaded on the servers (guarded by sync_mu_)
  std::vector<std::int64_t> to_delete_;     // unloaded, deleted at the next sync (retention)
  std::unique_ptr<http::BlockingClient> sync_client_;

  std::optional<DistEnv> dist_env_;
  std::unique_ptr<DistGroup> dist_;
  std::int64_t dp_seq_ = 0;             // the next message's number
  std::set<std::int64_t> dp_versions_;  // snapshots the other ranks hold
  double dp_last_check_ = 0;
  std::string dp_error_;                // why the run stopped (for the other ranks)

  double last_step_end_ = 0, run_start_ = 0, flops_ = 0;
  std::int64_t steps_this_run_ = 0;
  bool tty_ = false;
};

// A data-parallel rank other than 0 (dp_worker.cpp): returns the process's exit code.
int run_dp_worker(const TrainArgs& args, const DistEnv& env);

}  // namespace lorasync::rl::detail
