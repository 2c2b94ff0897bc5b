// GPU test (label `gpu`, in the gpu_model binary; skips without a CUDA device): the data-parallel
// group's NCCL backend as this build links it against libtorch's (the header layout of the NCCL
// libtorch was built with): a one-rank group on cuda:0 all-reduces a CUDA tensor in place. Two
// ranks need two GPUs; scripts/gpu-check has one.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "rl/dist.h"

namespace lorasync::rl {
namespace {

TEST(Gpu, DataParallelGroupAllReducesCudaGradients) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  DistEnv env;
  env.world = 1;
  env.master_port = 0;
  DistOptions opts;
  opts.timeout_s = 60;
  auto dist = DistGroup::connect(env, opts);
  const std::string backend = dist->use_device(c10::Device(c10::kCUDA, 0));
  std::printf("gpu: data-parallel gradients by %s\n", backend.c_str());
  at::Tensor t = at::arange(1 << 20, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
  const at::Tensor want = t.clone();
  dist->allreduce_sum(t);
  EXPECT_TRUE(at::equal(t.cpu(), want.cpu()));
}

}  // namespace
}  // namespace lorasync::rl
