// GPU test (label `gpu`, in gpu_model; skips without a CUDA device): the sampler on logits that
// live on the GPU (sample_batch_tensor_ops: no copy of [B, V] to the host) against the host path
// on a CPU copy, with the same generators, and its time against copying the logits and sampling
// on the host (printed for scripts/gpu-check's log).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <random>

#include "engine/sampler.h"

namespace lorasync::engine {
namespace {

TEST(Gpu, SamplerOnCudaEqualsTheHostPath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(7);
  const std::int64_t B = 64, V = 151936;
  auto cpu_logits = at::randn({B, V}) * 4.0;
  auto gpu_logits = cpu_logits.to(at::Device(at::kCUDA, 0));
  std::vector<SamplingParams> params(static_cast<std::size_t>(B));
  for (std::int64_t i = 0; i < B; ++i) {
    auto& p = params[static_cast<std::size_t>(i)];
    p.temperature = i % 4 == 0 ? 0.0 : 1.0;
    p.logprobs = i % 3 == 0 ? 5 : 0;
    if (i % 10 == 3) p.top_p = 0.9;
  }
  auto run = [&](const at::Tensor& logits) {
    std::vector<std::mt19937_64> rngs;
    for (std::int64_t i = 0; i < B; ++i) rngs.emplace_back(1000 + static_cast<std::uint64_t>(i));
    std::vector<SampleRow> rows;
    for (std::int64_t i = 0; i < B; ++i) rows.push_back({&params[static_cast<std::size_t>(i)], &rngs[static_cast<std::size_t>(i)], nullptr});
    return sample_batch(logits, rows);
  };
  auto host = run(cpu_logits), dev = run(gpu_logits);
  int same = 0;
  for (std::int64_t i = 0; i < B; ++i) {
    const auto& h = host[static_cast<std::size_t>(i)];
    const auto& d = dev[static_cast<std::size_t>(i)];
    same += h.id == d.id;
    if (h.id == d.id) {
      EXPECT_NEAR(d.logprob, h.logprob, 1e-3) << "row " << i;
    }
    EXPECT_EQ(d.top.size(), h.top.size()) << "row " << i;
  }
  // fp32 softmax on the GPU rounds differently: a uniform within ~1e-7 of a token boundary may
  // pick the neighbour. Expect (nearly) every row equal.
  EXPECT_GE(same, B - 1);
  using clk = std::chrono::steady_clock;
  auto time_of = [&](auto f) {
    f();
    const auto t0 = clk::now();
    for (int k = 0; k < 20; ++k) f();
    return std::chrono::duration<double>(clk::now() - t0).count() / 20;
  };
  const double on_device = time_of([&] { (void)run(gpu_logits); });
  const double via_host = time_of([&] { (void)run(gpu_logits.to(at::kCPU)); });
  std::printf("gpu: sampler [%ld, %ld] on the device %.3f ms, copied to the host and sampled there %.3f ms; %d/%ld rows equal\n",
              static_cast<long>(B), static_cast<long>(V), on_device * 1e3, via_host * 1e3, same, static_cast<long>(B));
}

}  // namespace
}  // namespace lorasync::engine
