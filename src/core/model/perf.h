// core/model/perf.h: GEMM throughput measurement, the denominator of every utilisation figure
// (`lorasync bench gemm`, `bench forward`, `bench train`), and FLOP counts of the model.
// Thread-safety: functions are reentrant (they allocate their own tensors).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>

#include "core/model/model_config.h"

namespace lorasync::model {

// Seconds per call of f: one untimed warm-up call, then calls until min_seconds have passed,
// the device synchronised after each.
double seconds_per_call(const std::function<void()>& f, c10::Device device, double min_seconds);

// GFLOP/s of C[M,N] = A[M,K] B[K,N] (as at::linear computes it: x W^T), repeated for at least
// min_seconds after one warm-up call.
double gemm_gflops(std::int64_t m, std::int64_t n, std::int64_t k, c10::ScalarType dtype,
                   c10::Device device, double min_seconds = 0.3);

// The machine's fp32 (or given dtype) GEMM peak: the best of BLAS's square products 1024..4096
// and, in fp32 on CPU, of our outer-product kernel (cpu::linear_gemm, 512 x 1024..2048 x same).
double gemm_peak_gflops(c10::ScalarType dtype, c10::Device device, double min_seconds = 0.3);

// Forward FLOPs of `tokens` new tokens attending to `context` positions on average (causal
// prefill of length P: context = P/2), with the LM head evaluated on `lm_head_rows` rows.
double forward_flops(const ModelConfig& c, double tokens, double context, double lm_head_rows);

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

// Peak bytes of the tensors one training row of `tokens` tokens holds (forward + backward through
// a LoRA, the LM head at its completion positions in chunks of `logits_chunk` rows, activations
// in `dtype`), from a count of what each decoder layer keeps for its backward pass:
//   kept per layer and token  k = (4 d + 3 q + 3 kv + 4 i) b     (norm inputs/outputs, q/k/v
//                                 before and after RoPE, attention output, gate/up/SiLU/product)
//   one layer's backward adds 2 i b (the gradients of gate and up)
//   keeping activations:      tokens (n_layers k + 2 i b + 3 d b)
//   checkpointed layers:      tokens (n_layers d b + k + 2 i b + 3 d b)   (layer inputs + one layer)
//   plus one LM-head chunk    logits_chunk V 4
// (b = bytes of dtype). Measured at the 1.5B shape in fp32 with checkpointing and 128-row chunks
// (bench train, docs/benchmarks.md): 0.429 MiB per token; this gives 0.431, and 4-11% more than
// the measured totals (the chunk's term). Weights, the optimizer and the allocator's slack are not
// in it.
std::int64_t training_row_bytes(const ModelConfig& c, c10::ScalarType dtype, std::int64_t tokens,
                                std::int64_t logits_chunk, bool checkpointing);

// Bytes a training step can still allocate on `device`: on CPU the kernel's MemAvailable, bounded
// by the cgroup's memory limit less its usage; on CUDA the device's free memory plus what the
// caching allocator holds unused. -1 when unknown.
std::int64_t available_memory_bytes(c10::Device device);

// Synchronises the device (CUDA) so wall-clock timings are real; no-op on CPU.
void device_synchronize(c10::Device device);

}  // namespace lorasync::model
