// core/model/cpu_kernels_impl.h: what the CPU kernels' implementation files (cpu_kernels.cpp,
// cpu_gemm.cpp) share; never included by other headers. The x86 intrinsics and LS_X86 (1 where
// they exist): which kernels run is decided at run time (__builtin_cpu_supports), so the baseline
// ISA stays the compiler's. And the split of a linear's weight rows into chunks for the threads.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/model/cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LS_X86 1
#else
#define LS_X86 0
#endif

namespace lorasync::model::cpu::detail {

// Rows [n0, n1) of part `part` (a weight matrix, or a LoRA delta's rows or outputs).
struct Chunk {
  std::size_t part;
  std::int64_t n0, n1;
};

// Every part's n_out weight rows in chunks of `per` rows (the last of a part shorter).
inline std::vector<Chunk> weight_chunks(std::span<const LinearOut> parts, std::int64_t per) {
  std::vector<Chunk> chunks;
  for (std::size_t i = 0; i < parts.size(); ++i)
    for (std::int64_t n = 0; n < parts[i].n_out; n += per) chunks.push_back({i, n, std::min(parts[i].n_out, n + per)});
  return chunks;
}

}  // namespace lorasync::model::cpu::detail
