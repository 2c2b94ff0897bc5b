// rl/dist.h: the data-parallel ranks of `lorasync train` (docs/trainer.md "Data-parallel ranks")
// on c10d: a TCPStore for rendezvous, messages and heartbeats, a Gloo process group for the
// statistics and CPU gradients, and an NCCL one for CUDA gradients where the build has NCCL
// (otherwise CUDA gradients are staged through host memory: a LoRA's few MB).
//
// Ranks come from the standard launcher variables (torchrun, SLURM via srun wrappers, Kubernetes,
// or `lorasync train --nproc-per-node N`, which sets them for its children):
//   RANK, WORLD_SIZE, LOCAL_RANK (default RANK), MASTER_ADDR (default 127.0.0.1), MASTER_PORT,
//   TORCHELASTIC_USE_AGENT_STORE=True when the launcher hosts the store (rank 0 hosts it otherwise).
// GLOO_SOCKET_IFNAME picks Gloo's network interface, as in PyTorch.
//
// Liveness: every rank bumps a counter in the store every second from its own thread (own
// connection); a rank whose counter has not moved for `silent_after_s` is reported as stopped.
// Collective failures are rethrown naming the ranks that stopped answering.
//
// Thread-safety: one thread uses a DistGroup (the trainer's); the heartbeat runs on its own.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace lorasync::rl {

struct DistEnv {
  int rank = 0, world = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  bool agent_store = false;  // the launcher hosts the TCPStore: rank 0 connects as a client
  int listen_fd = -1;        // LORASYNC_STORE_LISTEN_FD: rank 0's store socket, bound by --nproc-per-node
  std::string key_prefix = "lorasync/0/";  // per launcher attempt (TORCHELASTIC_RESTART_COUNT)
  // nullopt without WORLD_SIZE (or WORLD_SIZE=1); Error(InvalidInput) naming a bad variable.
  static std::optional<DistEnv> from_environment();
};

struct DistOptions {
  double timeout_s = 1800;     // collectives and store operations (PyTorch's default)
  double silent_after_s = 15;  // a heartbeat unchanged this long: the rank stopped answering
  // LORASYNC_DIST_TIMEOUT_S and LORASYNC_DIST_SILENT_S over the defaults.
  static DistOptions from_environment();
};

class DistGroup {
 public:
  // Connects to the store (hosting it on rank 0 unless agent_store), then forms the Gloo group.
  static std::unique_ptr<DistGroup> connect(const DistEnv& env, const DistOptions& opts);
  ~DistGroup();
  DistGroup(const DistGroup&) = delete;
  DistGroup& operator=(const DistGroup&) = delete;

  // The gradient all-reduce for tensors on `device`: NCCL for CUDA where the build has it
  // (LORASYNC_DIST_BACKEND=gloo keeps Gloo), Gloo otherwise. Every rank calls it with its device
  // before the first step. Returns the backend's name, for the log.
  std::string use_device(c10::Device device);

  int rank() const;
  int world() const;

  // Store: values are bytes of any size (chunked under the store's payload limit). get_wait waits
  // for the key, checking that rank `watch` (-1: none) keeps answering (Error(Unavailable) naming
  // it otherwise); nullopt when `give_up` says so (checked each poll).
  void set(const std::string& key, const std::string& value);
  std::optional<std::string> get_wait(const std::string& key, int watch, const std::function<bool()>& give_up);
  void erase(const std::string& key);

  // Collectives (every rank calls them in the same order).
  void allreduce_sum(at::Tensor& flat);  // contiguous fp32/fp64, CPU or CUDA; in place
  std::vector<std::vector<double>> allgather(const std::vector<double>& mine);  // same length on every rank

  // Ranks whose heartbeat has not moved for silent_after_s (checked now; cheap, non-blocking).
  std::vector<int> silent_ranks();
  // "rank 1 stopped answering (no heartbeat for 16 s): ..." for a failed collective or store call.
  std::string describe_failure(const std::string& what, const std::exception& e);

 private:
  struct Impl;
  explicit DistGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorasync::rl
