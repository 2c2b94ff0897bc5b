// core/model/runtime.h: device, dtype and thread settings for libtorch, chosen at run time.
//
// The same code and the same libtorch (2.x, CUDA-enabled) run on CPU and on CUDA: nothing here or in
// the model hard-codes a device or a dtype. On CPU, fp32 is the compute dtype that performs
// (bf16 GEMM is ~20x slower on the development machines); `auto` picks it there.
// Thread-safety: set_compute_threads must be called at start-up, before parallel work.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <string>

namespace lorasync::model {

// "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", or "auto" (= fp32 on CPU, bf16 on CUDA).
// InvalidInput naming `what` for anything else.
c10::ScalarType parse_dtype(const std::string& name, c10::Device device, const std::string& what);
// "cpu", "cuda", "cuda:N". Unsupported (with the reason) when CUDA is asked for and absent.
c10::Device parse_device(const std::string& name);
std::string dtype_name(c10::ScalarType t);  // "float32", "bfloat16", "float16"

// Intra-op threads for libtorch (libtorch starts with 1 here); 0 = all hardware threads.
void set_compute_threads(int n);
int compute_threads();
// Ends the calling thread's pool of compute workers (OpenMP's), if it has one; its next parallel
// work starts a new one. A process in which only one thread computes should call it on every
// other thread that did parallel work (loading weights, zeroing the KV pool): libgomp's workers
// spin between parallel regions only while the process holds no more worker threads than CPUs,
// and an idle pool left by the loading thread made the engine's workers sleep and be woken at
// every region (5,700 context switches/s; batch-1 decode in `serve` 40% slower than in a bench).
void release_compute_threads();

// Installs, once per process, a CPU allocator that keeps freed large blocks for reuse: blocks of
// 1 MiB and more are rounded up to whole 2 MiB pages, mapped with transparent huge-page advice,
// and on free kept (up to max_cached_bytes in all) for the next allocation of the same size.
// A training step allocates and frees the same activation sizes row after row; from the system
// allocator each of them is a fresh mapping whose every 4 KiB page faults and is zeroed by the
// kernel on first touch (about 7% of a CPU step here). Smaller blocks go to libtorch's allocator.
// Later calls only change the cap. Returns the bytes cached now (for reports).
std::size_t use_cpu_block_cache(std::size_t max_cached_bytes);
// The cap the trainer and bench train use: a quarter of the machine's physical memory.
std::size_t default_cpu_block_cache_bytes();

}  // namespace lorasync::model
