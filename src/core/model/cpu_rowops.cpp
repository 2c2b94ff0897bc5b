// core/model/cpu_rowops.cpp: the CPU kernels that work row by row (RMS norm, RoPE, SiLU-and-mul,
// decode attention over the paged KV pool, the sampler's row max and exponentials), split from
// cpu_kernels.cpp (the linear and LoRA kernels) so that no file passes ~800 lines. Same run-time
// choice of AVX2 + FMA or portable code.
#include "core/model/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/model/cpu_kernels_impl.h"

namespace lorasync::model::cpu {

using namespace detail;

namespace {

#if LS_X86

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

}  // namespace

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
