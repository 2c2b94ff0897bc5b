// core/model/perf.h: GEMM throughput measurement, the denominator of every utilisation figure
// (`lorasync bench gemm`, `bench forward`, `bench train`), and FLOP counts of the model.
// Thread-safety: functions are reentrant (they allocate their own tensors).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "core/model/qwen2_config.h"

namespace lorasync::model {

// GFLOP/s of C[M,N] = A[M,K] B[K,N] (as at::linear computes it: x W^T), repeated for at least
// min_seconds after one warm-up call.
double gemm_gflops(std::int64_t m, std::int64_t n, std::int64_t k, c10::ScalarType dtype,
                   c10::Device device, double min_seconds = 0.3);

// The machine's fp32 (or given dtype) GEMM peak: the best of square products 1024..4096.
double gemm_peak_gflops(c10::ScalarType dtype, c10::Device device, double min_seconds = 0.3);

// Forward FLOPs of `tokens` new tokens attending to `context` positions on average (causal
// prefill of length P: context = P/2), with the LM head evaluated on `lm_head_rows` rows.
double forward_flops(const Qwen2Config& c, double tokens, double context, double lm_head_rows);

// Peak bytes allocated by libtorch's CUDA caching allocator since the last reset (0 on CPU).
std::int64_t peak_device_memory(c10::Device device);
void reset_peak_device_memory(c10::Device device);

// Counts the bytes of the CPU tensors libtorch allocates while it lives: it installs itself as the
// CPU allocator (over the current one, which does the work) and puts the previous one back on
// destruction. Tensors allocated before it are not counted; tensors freed after it are safe.
// For memory-growth tests and benches (measures tensors only: weights in huge pages, libraries and
// the allocator's own caches are not in it). Thread-safe counters; one meter at a time.
class CpuTensorMeter {
 public:
  CpuTensorMeter();
  ~CpuTensorMeter();
  CpuTensorMeter(const CpuTensorMeter&) = delete;
  CpuTensorMeter& operator=(const CpuTensorMeter&) = delete;
  std::int64_t current_bytes() const;
  std::int64_t peak_bytes() const;
  void reset_peak();  // peak = current

 private:
  struct Impl;
  Impl* impl_;
};

// Synchronises the device (CUDA) so wall-clock timings are real; no-op on CPU.
void device_synchronize(c10::Device device);

}  // namespace lorasync::model
