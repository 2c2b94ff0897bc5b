// core/model/cpu_kernels_impl.h: what the CPU kernels' implementation files (cpu_kernels.cpp,
// cpu_rowops.cpp, cpu_gemm.cpp) share; never included by other headers. The x86 intrinsics and
// LS_X86 (1 where they exist): which kernels run is decided at run time (__builtin_cpu_supports), so the baseline
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

// Kernel choice and the small vector helpers both files use (defined in cpu_kernels.cpp).
bool use_avx2();    // AVX2 + FMA present and the portable path not forced
bool use_avx512();  // use_avx2() and AVX-512F present and allowed (set_avx512_allowed)
float dot_portable(const float* a, const float* b, std::int64_t n);
void axpy_portable(float a, const float* x, float* y, std::int64_t n);
#if LS_X86
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, std::int64_t n);
__attribute__((target("avx2,fma"))) void axpy_avx2(float a, const float* x, float* y, std::int64_t n);

// The 8 sums of a[0..7], one per lane, in order.
__attribute__((target("avx2,fma"))) inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The eight dot products a . rows[u] of length n (a multiple of 8), lane u holding rows[u]'s:
// one accumulator per row, reduced together.
__attribute__((target("avx2,fma"))) inline __m256 dots8_avx2(const float* a, const float* const* rows,
                                                             std::int64_t n) {
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  for (std::int64_t d = 0; d < n; d += 8) {
    const __m256 av = _mm256_loadu_ps(a + d);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(av, _mm256_loadu_ps(rows[u] + d), acc[u]);
  }
  return hsum8(acc);
}

// exp(x) for x <= 0 (the shifted logits): x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial
// for e^r and 2^n through the exponent bits; 0 below -87 (where fp32 would go subnormal).
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(zero_mask, out);
}
#endif

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
