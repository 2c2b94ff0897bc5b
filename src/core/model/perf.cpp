#include "core/model/perf.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <chrono>

namespace lorasync::model {

void device_synchronize(c10::Device device) {
  if (device.is_cuda()) {
    // A tiny device-to-host copy waits for the queued kernels without a CUDA header here.
    (void)at::zeros({1}, at::TensorOptions().device(device)).cpu();
  }
}

std::int64_t peak_device_memory(c10::Device device) {
  if (!device.is_cuda()) return 0;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
  return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

void reset_peak_device_memory(c10::Device device) {
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index() < 0 ? 0 : device.index());
}

double gemm_gflops(std::int64_t m, std::int64_t n, std::int64_t k, c10::ScalarType dtype,
                   c10::Device device, double min_seconds) {
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  auto x = at::randn({m, k}, opts);
  auto w = at::randn({n, k}, opts);
  at::NoGradGuard ng;
  auto y = at::linear(x, w);  // warm-up
  device_synchronize(device);
  using clk = std::chrono::steady_clock;
  int iters = 0;
  auto t0 = clk::now();
  double elapsed = 0;
  do {
    y = at::linear(x, w);
    ++iters;
    device_synchronize(device);
    elapsed = std::chrono::duration<double>(clk::now() - t0).count();
  } while (elapsed < min_seconds);
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * iters /
         elapsed / 1e9;
}

double gemm_peak_gflops(c10::ScalarType dtype, c10::Device device, double min_seconds) {
  double best = 0;
  for (std::int64_t s : {1024, 2048, 4096})
    best = std::max(best, gemm_gflops(s, s, s, dtype, device, min_seconds));
  return best;
}

double forward_flops(const Qwen2Config& c, double tokens, double context, double lm_head_rows) {
  const double linear = 2.0 * static_cast<double>(c.n_linear_params()) * tokens;
  // QK^T and PV: 2 * 2 * d_attn per (query, key) pair, per layer.
  const double attn = 4.0 * static_cast<double>(c.num_hidden_layers) * static_cast<double>(c.q_dim()) *
                      tokens * context;
  const double head = 2.0 * static_cast<double>(c.hidden_size) * static_cast<double>(c.vocab_size) *
                      lm_head_rows;
  return linear + attn + head;
}

}  // namespace lorasync::model
