// rl/dist_nccl.cpp: c10d's NCCL process group for the gradient all-reduce of CUDA ranks, in its
// own file (its headers pull in the CUDA runtime and NCCL). Compiled where CMake finds nccl.h of
// the NCCL libtorch runs with (the wheel's nvidia-nccl package, the same 2.28 as CUDA 13's).
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <chrono>
#include <string>

namespace lorasync::rl {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix,
                                                    int rank, int world, std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix + "nccl", store);
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, world, opts);
}

}  // namespace lorasync::rl
