#include "core/model/cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "core/model/cpu_kernels_impl.h"

namespace lorasync::model::cpu {

namespace {

std::atomic<bool> g_force_portable{false};

bool cpu_has_avx2() {
#if LS_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

bool use_avx2() { return cpu_has_avx2() && !g_force_portable.load(std::memory_order_relaxed); }

// ---- portable kernels -----------------------------------------------------------------------
// Eight partial sums per dot product (the compiler vectorises them with the baseline ISA).

template <int MR>
void row_portable(const float* x, std::int64_t ldx, const float* w, std::int64_t K, float* y,
                  std::int64_t ldy, float bias) {
  float acc[MR][8] = {};
  std::int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int i = 0; i < MR; ++i)
      for (int u = 0; u < 8; ++u) acc[i][u] += x[i * ldx + k + u] * w[k + u];
  for (int i = 0; i < MR; ++i) {
    float s = 0;
    for (int u = 0; u < 8; ++u) s += acc[i][u];
    for (std::int64_t kk = k; kk < K; ++kk) s += x[i * ldx + kk] * w[kk];
    y[i * ldy] = s + bias;
  }
}

float dot_portable(const float* a, const float* b, std::int64_t n) {
  float acc[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) acc[u] += a[i + u] * b[i + u];
  float s = 0;
  for (int u = 0; u < 8; ++u) s += acc[u];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy_portable(float a, const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// ---- AVX2 + FMA kernels ---------------------------------------------------------------------
#if LS_X86
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// One row of w against MR rows of x: MR dot products of length K, two accumulators each (K
// unrolled by 16), the weight row loaded once for the MR rows. Weight rows are walked in memory
// order, one sequential stream per thread: interleaving several rows (a tile of NR rows) halves
// the bandwidth the hardware prefetcher sustains on short rows.
template <int MR>
__attribute__((target("avx2,fma"))) void row_avx2(const float* x, std::int64_t ldx, const float* w,
                                                  std::int64_t K, float* y, std::int64_t ldy, float bias) {
  __m256 a0[MR], a1[MR];
  for (int i = 0; i < MR; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
  std::int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    for (int i = 0; i < MR; ++i) {
      a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), w0, a0[i]);
      a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k + 8), w1, a1[i]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(w + k);
    for (int i = 0; i < MR; ++i) a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), w0, a0[i]);
  }
  for (int i = 0; i < MR; ++i) {
    float s = hsum(_mm256_add_ps(a0[i], a1[i]));
    for (std::int64_t kk = k; kk < K; ++kk) s += x[i * ldx + kk] * w[kk];
    y[i * ldy] = s + bias;
  }
}

// A single row of x: four accumulators (K unrolled by 32) to keep enough loads in flight.
__attribute__((target("avx2,fma"))) void row1_avx2(const float* x, std::int64_t, const float* w,
                                                   std::int64_t K, float* y, std::int64_t, float bias) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  std::int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(w + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s += x[k] * w[k];
  *y = s + bias;
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, std::int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
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

// silu(g) * u = g * sigmoid(g) * u with sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0,
// e / (1 + e) below.
__attribute__((target("avx2,fma"))) void silu_mul_avx2(const float* gate, const float* up, std::int64_t n,
                                                       float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_nonpos(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), g);  // sign bit of g picks e/(1+e)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

__attribute__((target("avx2,fma"))) float row_max_avx2(const float* x, std::int64_t n, float t) {
  const __m256 tv = _mm256_set1_ps(t);
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_div_ps(_mm256_loadu_ps(x + i), tv));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = lanes[0];
  for (int u = 1; u < 8; ++u) mx = std::max(mx, lanes[u]);
  for (; i < n; ++i) mx = std::max(mx, x[i] / t);
  return mx;
}

__attribute__((target("avx2,fma"))) double row_exp_blocks_avx2(const float* x, std::int64_t n, float t,
                                                               float shift, float* e, double* sums,
                                                               std::int64_t block) {
  const __m256 tv = _mm256_set1_ps(t), sv = _mm256_set1_ps(shift);
  double total = 0;
  for (std::int64_t b0 = 0, j = 0; b0 < n; b0 += block, ++j) {
    const std::int64_t b1 = std::min(n, b0 + block);
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    std::int64_t i = b0;
    for (; i + 8 <= b1; i += 8) {
      const __m256 v = exp_nonpos(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), tv), sv));
      if (e) _mm256_storeu_ps(e + i, v);
      acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
    double s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < b1; ++i) {
      const float v = std::exp(x[i] / t - shift);
      if (e) e[i] = v;
      s += v;
    }
    sums[j] = s;
    total += s;
  }
  return total;
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float a, const float* x, float* y, std::int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// y[j] += sum_k t[k] bt[k * n + j] for j < n: each piece of y loaded and stored once for r
// multiply-adds.
__attribute__((target("avx2,fma"))) void rank_update_avx2(const float* t, const float* bt, std::int64_t r,
                                                          std::int64_t n, float* y) {
  std::int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 a0 = _mm256_loadu_ps(y + j), a1 = _mm256_loadu_ps(y + j + 8);
    for (std::int64_t k = 0; k < r; ++k) {
      const __m256 tk = _mm256_broadcast_ss(t + k);
      a0 = _mm256_fmadd_ps(tk, _mm256_loadu_ps(bt + k * n + j), a0);
      a1 = _mm256_fmadd_ps(tk, _mm256_loadu_ps(bt + k * n + j + 8), a1);
    }
    _mm256_storeu_ps(y + j, a0);
    _mm256_storeu_ps(y + j + 8, a1);
  }
  for (; j < n; ++j) {
    float acc = y[j];
    for (std::int64_t k = 0; k < r; ++k) acc += t[k] * bt[k * n + j];
    y[j] = acc;
  }
}
// rank_update_avx2 for four rows at once: y_u[j] += t_u . bt[:, j] for u < 4, each bt vector
// loaded once for the four rows, eight independent accumulators (16 outputs x 4 rows) per k.
__attribute__((target("avx2,fma"))) void rank_update4_avx2(const float* const* t, const float* bt, std::int64_t r,
                                                           std::int64_t n, float* const* y) {
  std::int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m256 a[4][2];
    for (int u = 0; u < 4; ++u) {
      a[u][0] = _mm256_loadu_ps(y[u] + j);
      a[u][1] = _mm256_loadu_ps(y[u] + j + 8);
    }
    for (std::int64_t k = 0; k < r; ++k) {
      const __m256 b0 = _mm256_loadu_ps(bt + k * n + j), b1 = _mm256_loadu_ps(bt + k * n + j + 8);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m256 tk = _mm256_broadcast_ss(t[u] + k);
        a[u][0] = _mm256_fmadd_ps(tk, b0, a[u][0]);
        a[u][1] = _mm256_fmadd_ps(tk, b1, a[u][1]);
      }
    }
    for (int u = 0; u < 4; ++u) {
      _mm256_storeu_ps(y[u] + j, a[u][0]);
      _mm256_storeu_ps(y[u] + j + 8, a[u][1]);
    }
  }
  for (; j < n; ++j)
    for (int u = 0; u < 4; ++u) {
      float acc = y[u][j];
      for (std::int64_t k = 0; k < r; ++k) acc += t[u][k] * bt[k * n + j];
      y[u][j] = acc;
    }
}

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

// y[j] += t . b_j for j < n, the rows b_j of B [*, r] (r a multiple of 8) read in place, eight
// outputs at a time. No transposed copy of B, which at a few rows per adapter cost more than the
// products.
__attribute__((target("avx2,fma"))) void rank_update_rows_avx2(const float* t, const float* b, std::int64_t r,
                                                               std::int64_t n, float* y) {
  std::int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* rows[8];
    for (int u = 0; u < 8; ++u) rows[u] = b + (j + u) * r;
    _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), dots8_avx2(t, rows, r)));
  }
  for (; j < n; ++j) y[j] += dot_avx2(t, b + j * r, r);
}

// s[j] = scale * (q . k_j) for the L keys at kp[j] (hd a multiple of 8), eight keys at a time.
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, const float* const* kp, std::int64_t L,
                                                     std::int64_t hd, float scale, float* s) {
  const __m256 sc = _mm256_set1_ps(scale);
  std::int64_t j = 0;
  for (; j + 8 <= L; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(dots8_avx2(q, kp + j, hd), sc));
  for (; j < L; ++j) s[j] = dot_avx2(q, kp[j], hd) * scale;
}

// out[0 .. 8 NC) = sum_j p[j] v_j[d0 ..] for the L values at vp[j] + d0: the output in registers.
template <int NC>
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* p, const float* const* vp, std::int64_t L,
                                                           std::int64_t d0, float* out) {
  __m256 acc[NC];
  for (int u = 0; u < NC; ++u) acc[u] = _mm256_setzero_ps();
  for (std::int64_t j = 0; j < L; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
    const float* v = vp[j] + d0;
#pragma GCC unroll 8
    for (int u = 0; u < NC; ++u) acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * u), acc[u]);
  }
  for (int u = 0; u < NC; ++u) _mm256_storeu_ps(out + 8 * u, acc[u]);
}

// softmax in place over s[0 .. L): exp(s - max) / sum, the exponentials vectorised.
__attribute__((target("avx2,fma"))) void softmax_avx2(float* s, std::int64_t L) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  std::int64_t j = 0;
  for (; j + 8 <= L; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float mx = lanes[0];
  for (int u = 1; u < 8; ++u) mx = std::max(mx, lanes[u]);
  for (; j < L; ++j) mx = std::max(mx, s[j]);
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_store_ps(lanes, sum);
  double total = 0;
  for (int u = 0; u < 8; ++u) total += lanes[u];
  for (; j < L; ++j) {
    s[j] = std::exp(s[j] - mx);
    total += s[j];
  }
  const __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / total));
  j = 0;
  for (; j + 8 <= L; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
  for (; j < L; ++j) s[j] *= static_cast<float>(1.0 / total);
}

// One (sequence, KV head) task of decode_attention, hd a multiple of 8: per query head, its scores
// eight keys at a time, a vectorised softmax, then the weighted values summed into registers, up
// to 64 dimensions at a time.
__attribute__((target("avx2,fma"))) void attention_task_avx2(const float* qb, const float* const* kp,
                                                             const float* const* vp, std::int64_t L,
                                                             std::int64_t g, std::int64_t hd, float scale,
                                                             float* s, float* ob) {
  using WeightedSum = void (*)(const float*, const float* const*, std::int64_t, std::int64_t, float*);
  static constexpr WeightedSum kSums[9] = {nullptr,
                                           weighted_sum_avx2<1>,
                                           weighted_sum_avx2<2>,
                                           weighted_sum_avx2<3>,
                                           weighted_sum_avx2<4>,
                                           weighted_sum_avx2<5>,
                                           weighted_sum_avx2<6>,
                                           weighted_sum_avx2<7>,
                                           weighted_sum_avx2<8>};
  for (std::int64_t i = 0; i < g; ++i) {
    scores_avx2(qb + i * hd, kp, L, hd, scale, s);
    softmax_avx2(s, L);
    for (std::int64_t d0 = 0; d0 < hd; d0 += 64) {
      const auto nc = static_cast<int>(std::min<std::int64_t>(64, hd - d0) / 8);
      kSums[nc](s, vp, L, d0, ob + i * hd + d0);
    }
  }
}
#endif

using RowFn = void (*)(const float*, std::int64_t, const float*, std::int64_t, float*, std::int64_t, float);

// Rows [n0, n1) of one weight matrix against all M rows of x, weight rows in memory order; rows
// of x four at a time (the weight row is read from memory once, from L1 for the other groups).
void rows_range(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx, const LinearOut& p,
                std::int64_t n0, std::int64_t n1, bool avx) {
  RowFn r1 = row_portable<1>, r2 = row_portable<2>, r4 = row_portable<4>;
#if LS_X86
  if (avx) {
    r1 = row1_avx2;
    r2 = row_avx2<2>;
    r4 = row_avx2<4>;
  }
#endif
  (void)avx;
  for (std::int64_t n = n0; n < n1; ++n) {
    const float* w = p.w + n * K;
    const float b = p.bias ? p.bias[n] : 0.0f;
    std::int64_t m = 0;
    for (; m + 4 <= M; m += 4) r4(x + m * ldx, ldx, w, K, p.y + m * p.ldy + n, p.ldy, b);
    for (; m + 2 <= M; m += 2) r2(x + m * ldx, ldx, w, K, p.y + m * p.ldy + n, p.ldy, b);
    for (; m < M; ++m) r1(x + m * ldx, ldx, w, K, p.y + m * p.ldy + n, p.ldy, b);
  }
}

using detail::Chunk;

}  // namespace

void parallel_for(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& f) {
  at::parallel_for(0, n, 1, [&](std::int64_t b, std::int64_t e) { f(b, e); });
}

void parallel_for_cost(std::int64_t n, const std::function<std::int64_t(std::int64_t)>& cost,
                       const std::function<void(std::int64_t, std::int64_t)>& f) {
  const std::int64_t T = at::get_num_threads();
  if (n < 2 || T < 2 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  std::vector<std::int64_t> prefix(static_cast<std::size_t>(n) + 1, 0);
  for (std::int64_t i = 0; i < n; ++i) prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + cost(i);
  const std::int64_t total = prefix.back();
  // Piece t starts at the first task whose running total reaches t / T of the whole.
  auto start = [&](std::int64_t t) -> std::int64_t {
    if (t >= T) return n;
    const auto share = static_cast<std::int64_t>(static_cast<double>(total) * static_cast<double>(t) / static_cast<double>(T));
    return std::lower_bound(prefix.begin(), prefix.end(), share) - prefix.begin();
  };
  at::parallel_for(0, T, 1, [&](std::int64_t tb, std::int64_t te) {
    for (std::int64_t t = tb; t < te; ++t) {
      const std::int64_t b = start(t), e = start(t + 1);
      if (b < e) f(b, e);
    }
  });
}

bool set_force_portable(bool on) { return g_force_portable.exchange(on); }

bool linear_gemm_available() { return cpu_has_avx2(); }

void linear(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx,
            std::span<const LinearOut> parts) {
  if (M >= kGemmMinRows && use_avx2()) return linear_gemm(x, M, K, ldx, parts);
  linear_rows(x, M, K, ldx, parts);
}

void linear_rows(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx,
                 std::span<const LinearOut> parts) {
  if (M <= 0) return;
  // Chunks of weight rows small enough to balance the threads, large enough (>= 64 KiB of
  // weights) that a chunk's start-up cost is noise.
  const std::int64_t rows_per_chunk = std::max<std::int64_t>(8, ((16384 / std::max<std::int64_t>(K, 1)) + 7) / 8 * 8);
  const auto chunks = detail::weight_chunks(parts, rows_per_chunk);
  const bool avx = use_avx2();
  auto rows_of = [&](std::int64_t c) { return chunks[static_cast<std::size_t>(c)].n1 - chunks[static_cast<std::size_t>(c)].n0; };
  parallel_for_cost(static_cast<std::int64_t>(chunks.size()), rows_of, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t c = b; c < e; ++c) {
      const Chunk& ch = chunks[static_cast<std::size_t>(c)];
      rows_range(x, M, K, ldx, parts[ch.part], ch.n0, ch.n1, avx);
    }
  });
}

void lora_b_updates(std::span<const LoraBUpdate> updates) {
  const bool avx = use_avx2();
  std::int64_t macs = 0, n_rows = 0;
  for (const auto& u : updates) {
    macs += u.n_rows * u.out * u.r;
    n_rows += u.n_rows;
  }
  // Row i of update u: y[row] += B (scale * t[row]), the scaled t in a per-thread buffer.
  auto one_row = [avx](const LoraBUpdate& u, std::int64_t i) {
    thread_local std::vector<float> ts;
    ts.resize(static_cast<std::size_t>(u.r));
    const std::int64_t row = u.rows ? u.rows[i] : i;
    const float* t = u.t + row * u.ldt;
    for (std::int64_t k = 0; k < u.r; ++k) ts[static_cast<std::size_t>(k)] = t[k] * u.scale;
    float* y = u.y + row * u.ldy;
#if LS_X86
    if (avx) {
      if (u.r % 8 == 0) {
        rank_update_rows_avx2(ts.data(), u.B, u.r, u.out, y);
      } else {
        for (std::int64_t j = 0; j < u.out; ++j) y[j] += dot_avx2(ts.data(), u.B + j * u.r, u.r);
      }
      return;
    }
#endif
    for (std::int64_t j = 0; j < u.out; ++j) {
      const float* b = u.B + j * u.r;
      float acc = 0;
      for (std::int64_t k = 0; k < u.r; ++k) acc += ts[static_cast<std::size_t>(k)] * b[k];
      y[j] += acc;
    }
  };
  if (macs < kLoraSerialMacs) {
    for (const auto& u : updates)
      for (std::int64_t i = 0; i < u.n_rows; ++i) one_row(u, i);
    return;
  }
  std::vector<std::pair<std::size_t, std::int64_t>> tasks;  // (update, row index)
  tasks.reserve(static_cast<std::size_t>(n_rows));
  for (std::size_t k = 0; k < updates.size(); ++k)
    for (std::int64_t i = 0; i < updates[k].n_rows; ++i) tasks.emplace_back(k, i);
  parallel_for(static_cast<std::int64_t>(tasks.size()), [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t c = b; c < e; ++c) {
      const auto& [k, i] = tasks[static_cast<std::size_t>(c)];
      one_row(updates[k], i);
    }
  });
}

void lora_deltas(const float* x, std::int64_t ldx, std::int64_t in, std::span<const LoraDelta> deltas) {
  constexpr std::int64_t kRowBlock = 8;     // rows of x gathered per task of the A products
  constexpr std::int64_t kOutBlock = 256;   // outputs per task of the B products
  // From this many rows an adapter's B block is transposed once and its rows run four at a time
  // (rank_update4_avx2: each B vector loaded once for four rows, no horizontal sums); below, B is
  // read in place for ranks that are multiples of 8 (a transposed copy costs more than a few
  // rows' products). 5 adapters of rank 8 on a 1,024-token prefill: the in-place B products were
  // most of the adapters' cost.
  constexpr std::int64_t kTransposeRows = 8;
  const bool avx = use_avx2();
  // t = (A x) * scale, per delta n_rows x r, one buffer.
  std::vector<std::int64_t> t_off(deltas.size() + 1, 0);
  std::vector<Chunk> a_tasks, b_tasks;  // Chunk::part = delta, [n0, n1) = rows or outputs
  for (std::size_t d = 0; d < deltas.size(); ++d) {
    const auto& dl = deltas[d];
    t_off[d + 1] = t_off[d] + dl.n_rows * dl.r;
    for (std::int64_t n = 0; n < dl.out; n += kOutBlock) b_tasks.push_back({d, n, std::min(dl.out, n + kOutBlock)});
  }
  thread_local std::vector<float> t_buf;
  t_buf.resize(static_cast<std::size_t>(t_off.back()));
  float* t = t_buf.data();
  // An adapter with many rows (a prefill chunk): its rows gathered once and all its A products in
  // one linear() on the outer-product kernel; the small ones below, as (delta, rows) tasks.
  std::vector<bool> done(deltas.size(), false);
  thread_local std::vector<float> gathered;
  for (std::size_t d = 0; d < deltas.size(); ++d) {
    if (done[d] || deltas[d].n_rows < kGemmMinRows) continue;
    const LoraDelta& lead = deltas[d];
    const float* xs = x;
    std::int64_t ldxs = ldx;
    if (lead.rows != nullptr) {
      gathered.resize(static_cast<std::size_t>(lead.n_rows * in));
      for (std::int64_t i = 0; i < lead.n_rows; ++i) std::copy_n(x + lead.rows[i] * ldx, in, gathered.data() + i * in);
      xs = gathered.data();
      ldxs = in;
    }
    std::vector<LinearOut> parts;
    std::vector<std::size_t> members;
    for (std::size_t e = d; e < deltas.size(); ++e)
      if (!done[e] && deltas[e].rows == lead.rows && deltas[e].n_rows == lead.n_rows) {
        parts.push_back({deltas[e].A, nullptr, deltas[e].r, t + t_off[e], deltas[e].r});
        members.push_back(e);
        done[e] = true;
      }
    linear(xs, lead.n_rows, in, ldxs, parts);
    for (std::size_t e : members)
      for (std::int64_t i = t_off[e]; i < t_off[e + 1]; ++i) t[i] *= deltas[e].scale;
  }
  for (std::size_t d = 0; d < deltas.size(); ++d)
    if (!done[d])
      for (std::int64_t i = 0; i < deltas[d].n_rows; i += kRowBlock)
        a_tasks.push_back({d, i, std::min(deltas[d].n_rows, i + kRowBlock)});
  parallel_for(static_cast<std::int64_t>(a_tasks.size()), [&](std::int64_t b, std::int64_t e) {
    thread_local std::vector<float> xs;
    xs.resize(static_cast<std::size_t>(kRowBlock * in));
    for (std::int64_t c = b; c < e; ++c) {
      const Chunk& task = a_tasks[static_cast<std::size_t>(c)];
      const LoraDelta& dl = deltas[task.part];
      const std::int64_t n = task.n1 - task.n0;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t row = dl.rows ? dl.rows[task.n0 + i] : task.n0 + i;
        std::copy_n(x + row * ldx, in, xs.data() + i * in);
      }
      float* tt = t + t_off[task.part] + task.n0 * dl.r;
      rows_range(xs.data(), n, in, in, LinearOut{dl.A, nullptr, dl.r, tt, dl.r}, 0, dl.r, avx);
      for (std::int64_t i = 0; i < n * dl.r; ++i) tt[i] *= dl.scale;
    }
  });
  parallel_for(static_cast<std::int64_t>(b_tasks.size()), [&](std::int64_t b, std::int64_t e) {
    thread_local std::vector<float> bt;
    for (std::int64_t c = b; c < e; ++c) {
      const Chunk& task = b_tasks[static_cast<std::size_t>(c)];
      const LoraDelta& dl = deltas[task.part];
      const std::int64_t n = task.n1 - task.n0;
#if LS_X86
      if (avx && dl.r % 8 == 0 && dl.n_rows < kTransposeRows) {  // B read in place
        for (std::int64_t i = 0; i < dl.n_rows; ++i) {
          const std::int64_t row = dl.rows ? dl.rows[i] : i;
          rank_update_rows_avx2(t + t_off[task.part] + i * dl.r, dl.B + task.n0 * dl.r, dl.r, n,
                                dl.y + row * dl.ldy + task.n0);
        }
        continue;
      }
#endif
      // This block of B transposed: bt[k][j] = B[n0 + j][k].
      bt.resize(static_cast<std::size_t>(dl.r * n));
      for (std::int64_t j = 0; j < n; ++j)
        for (std::int64_t k = 0; k < dl.r; ++k) bt[static_cast<std::size_t>(k * n + j)] = dl.B[(task.n0 + j) * dl.r + k];
      std::int64_t i0 = 0;
#if LS_X86
      if (avx)  // four rows at a time
        for (; i0 + 4 <= dl.n_rows; i0 += 4) {
          const float* ts[4];
          float* ys[4];
          for (int u = 0; u < 4; ++u) {
            const std::int64_t i = i0 + u, row = dl.rows ? dl.rows[i] : i;
            ts[u] = t + t_off[task.part] + i * dl.r;
            ys[u] = dl.y + row * dl.ldy + task.n0;
          }
          rank_update4_avx2(ts, bt.data(), dl.r, n, ys);
        }
#endif
      for (std::int64_t i = i0; i < dl.n_rows; ++i) {
        const std::int64_t row = dl.rows ? dl.rows[i] : i;
        const float* ti = t + t_off[task.part] + i * dl.r;
        float* y = dl.y + row * dl.ldy + task.n0;
#if LS_X86
        if (avx) {
          rank_update_avx2(ti, bt.data(), dl.r, n, y);
          continue;
        }
#endif
        for (std::int64_t j = 0; j < n; ++j) {
          float acc = y[j];
          for (std::int64_t k = 0; k < dl.r; ++k) acc += ti[k] * bt[static_cast<std::size_t>(k * n + j)];
          y[j] = acc;
        }
      }
    }
  });
}

static void rms_norm_rows(const float* x, const float* w, float eps, std::int64_t m0, std::int64_t m1,
                   std::int64_t d, float* out);
static void rope_rows(float* x, std::int64_t m0, std::int64_t m1, std::int64_t ld, std::int64_t heads,
               std::int64_t hd, const std::int64_t* positions, const float* inv_freq);

// Elementwise steps split their rows over the threads only when a step has this many elements
// (a decode step's few rows are cheaper on one thread than a parallel region).
constexpr std::int64_t kParallelElems = std::int64_t{1} << 16;

template <class F>
void over_rows(std::int64_t M, std::int64_t row_elems, const F& f) {
  if (M * row_elems < kParallelElems) return f(0, M);
  parallel_for(M, [&](std::int64_t b, std::int64_t e) { f(b, e); });
}

void rms_norm(const float* x, const float* w, float eps, std::int64_t M, std::int64_t d, float* out) {
  over_rows(M, d, [&](std::int64_t m0, std::int64_t m1) { rms_norm_rows(x, w, eps, m0, m1, d, out); });
}

static void rms_norm_rows(const float* x, const float* w, float eps, std::int64_t m0, std::int64_t m1,
                   std::int64_t d, float* out) {
  for (std::int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * d;
    double ss = 0;
    for (std::int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float var = static_cast<float>(ss / static_cast<double>(d));
    const float r = 1.0f / std::sqrt(var + eps);
    float* o = out + m * d;
    for (std::int64_t i = 0; i < d; ++i) o[i] = w[i] * (xr[i] * r);
  }
}

void rope(float* x, std::int64_t M, std::int64_t ld, std::int64_t heads, std::int64_t hd,
          const std::int64_t* positions, const float* inv_freq) {
  over_rows(M, heads * hd, [&](std::int64_t m0, std::int64_t m1) {
    rope_rows(x, m0, m1, ld, heads, hd, positions, inv_freq);
  });
}

static void rope_rows(float* x, std::int64_t m0, std::int64_t m1, std::int64_t ld, std::int64_t heads,
               std::int64_t hd, const std::int64_t* positions, const float* inv_freq) {
  const std::int64_t half = hd / 2;
  std::vector<float> c(static_cast<std::size_t>(half)), s(static_cast<std::size_t>(half));
  for (std::int64_t m = m0; m < m1; ++m) {
    const float p = static_cast<float>(positions[m]);
    for (std::int64_t i = 0; i < half; ++i) {
      const float a = p * inv_freq[i];
      c[static_cast<std::size_t>(i)] = std::cos(a);
      s[static_cast<std::size_t>(i)] = std::sin(a);
    }
    for (std::int64_t h = 0; h < heads; ++h) {
      float* v = x + m * ld + h * hd;
      for (std::int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        const float ci = c[static_cast<std::size_t>(i)], si = s[static_cast<std::size_t>(i)];
        v[i] = x1 * ci - x2 * si;
        v[i + half] = x2 * ci + x1 * si;
      }
    }
  }
}

void silu_mul(const float* gate, const float* up, std::int64_t n, float* out) {
  // In pieces of 4096 elements (a multiple of the vector width) spread over the threads.
  const std::int64_t piece = 4096, pieces = (n + piece - 1) / piece;
  over_rows(pieces, piece, [&](std::int64_t p0, std::int64_t p1) {
    const std::int64_t b = p0 * piece, e = std::min(n, p1 * piece);
#if LS_X86
    if (use_avx2()) return silu_mul_avx2(gate + b, up + b, e - b, out + b);
#endif
    for (std::int64_t i = b; i < e; ++i) {
      const float g = gate[i];
      out[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
  });
}

void decode_attention(const float* q, const float* k_pool, const float* v_pool, std::int64_t nh,
                      std::int64_t nkv, std::int64_t hd, std::int64_t B, const std::int64_t* rows,
                      const std::int64_t* const* slots, const std::int64_t* lens, float* out) {
  const std::int64_t g = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float (*dot)(const float*, const float*, std::int64_t) = dot_portable;
  void (*axpy)(float, const float*, float*, std::int64_t) = axpy_portable;
#if LS_X86
  if (use_avx2()) {
    dot = dot_avx2;
    axpy = axpy_avx2;
  }
#endif
#if LS_X86
  const bool fast = use_avx2() && hd % 8 == 0;
#endif
  // One task per (sequence, KV head): the keys and values of that head are read from memory once
  // for the g query heads that share them.
  parallel_for(B * nkv, [&](std::int64_t t0, std::int64_t t1) {
    std::vector<float> scores, inv(static_cast<std::size_t>(g));
    std::vector<const float*> kp, vp;
    for (std::int64_t t = t0; t < t1; ++t) {
      const std::int64_t b = t / nkv, h = t % nkv, L = lens[b];
      const std::int64_t* sl = slots[b];
#if LS_X86
      if (fast) {
        kp.resize(static_cast<std::size_t>(L));
        vp.resize(static_cast<std::size_t>(L));
        for (std::int64_t j = 0; j < L; ++j) {
          kp[static_cast<std::size_t>(j)] = k_pool + (sl[j] * nkv + h) * hd;
          vp[static_cast<std::size_t>(j)] = v_pool + (sl[j] * nkv + h) * hd;
        }
        scores.resize(static_cast<std::size_t>(L));
        const std::int64_t row = rows ? rows[b] : b;
        attention_task_avx2(q + (row * nh + h * g) * hd, kp.data(), vp.data(), L, g, hd, scale, scores.data(),
                            out + (row * nh + h * g) * hd);
        continue;
      }
#endif
      scores.assign(static_cast<std::size_t>(g * L), 0.0f);
      const std::int64_t row = rows ? rows[b] : b;
      const float* qb = q + (row * nh + h * g) * hd;
      for (std::int64_t j = 0; j < L; ++j) {
        const float* kj = k_pool + (sl[j] * nkv + h) * hd;
        for (std::int64_t i = 0; i < g; ++i)
          scores[static_cast<std::size_t>(i * L + j)] = dot(qb + i * hd, kj, hd) * scale;
      }
      float* ob = out + (row * nh + h * g) * hd;
      std::fill(ob, ob + g * hd, 0.0f);
      for (std::int64_t i = 0; i < g; ++i) {
        float* s = scores.data() + i * L;
        float mx = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j < L; ++j) mx = std::max(mx, s[j]);
        double sum = 0;
        for (std::int64_t j = 0; j < L; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        inv[static_cast<std::size_t>(i)] = static_cast<float>(1.0 / sum);
      }
      for (std::int64_t j = 0; j < L; ++j) {
        const float* vj = v_pool + (sl[j] * nkv + h) * hd;
        for (std::int64_t i = 0; i < g; ++i)
          axpy(scores[static_cast<std::size_t>(i * L + j)] * inv[static_cast<std::size_t>(i)], vj,
               ob + i * hd, hd);
      }
    }
  });
}

float row_max(const float* x, std::int64_t n, float t) {
#if LS_X86
  if (use_avx2()) return row_max_avx2(x, n, t);
#endif
  float mx = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i] / t);
  return mx;
}

double row_exp_blocks(const float* x, std::int64_t n, float t, float shift, float* e,
                      double* block_sums, std::int64_t block) {
#if LS_X86
  if (use_avx2()) return row_exp_blocks_avx2(x, n, t, shift, e, block_sums, block);
#endif
  double total = 0;
  for (std::int64_t b0 = 0, j = 0; b0 < n; b0 += block, ++j) {
    double s = 0;
    for (std::int64_t i = b0; i < std::min(n, b0 + block); ++i) {
      const float z = x[i] / t - shift;
      const float v = z < -87.0f ? 0.0f : std::exp(z);
      if (e) e[i] = v;
      s += v;
    }
    block_sums[j] = s;
    total += s;
  }
  return total;
}

}  // namespace lorasync::model::cpu
