// core/model/cpu_attention.cpp: cpu::causal_attention, the causal attention of a prefill chunk on
// CPU (flash-style: key blocks with an online softmax, never the whole [L, S] score matrix).
//
// Work unit: one KV head and a block of kQueryBlock query tokens. Its g = nh / nkv query heads
// share every key and value block, so the block's rows are (token, head) pairs: M = tokens x g rows
// against the same keys. Per key block of kKeyBlock keys (only those the block's last token sees):
//   S = Q K^T  register tiles of R rows x 16 keys over a transposed copy of the key block (Q is
//              copied once per unit, scaled by 1/sqrt(hd));
//   P = exp(S - m)  per row, the running max m and sum l updated (keys past a row's diagonal are
//              -inf); the row's output accumulator is rescaled when its max moves;
//   O += P V   register tiles of R rows x 16 dimensions, V read in place (rows of the KV buffer).
// Units are shared among the threads by cost (a later query block sees more keys). The products
// cost the causal half of the scores (to within a block), and the g heads of a KV head read each
// key once; libtorch's CPU flash kernel repeats K and V per query head (GQA expanded by a copy).
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/model/cpu_kernels.h"

#include "core/model/cpu_kernels_impl.h"

namespace lorasync::model::cpu {

using namespace detail;

namespace {

constexpr std::int64_t kQueryBlock = 16;  // tokens per unit (x g heads = the unit's rows)
constexpr std::int64_t kKeyBlock = 64;    // keys per block (S is M x 64 floats)

#if LS_X86
// S[r][0..16) for R rows: Q rows (hd floats each) against 16 keys of the transposed block Kt
// [hd][kKeyBlock] from column c.
template <int R>
__attribute__((target("avx2,fma"))) void qk_tile(const float* qp, std::int64_t hd, const float* kt, std::int64_t c,
                                                 float* s) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (std::int64_t d = 0; d < hd; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kKeyBlock + c), k1 = _mm256_loadu_ps(kt + d * kKeyBlock + c + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_broadcast_ss(qp + r * hd + d);
      acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * kKeyBlock + c, acc[r][0]);
    _mm256_storeu_ps(s + r * kKeyBlock + c + 8, acc[r][1]);
  }
}

// O[r][d0..d0+16) += sum_j P[r][j] V[j][d0..d0+16) for R rows over kn keys; V rows `ldv` apart.
template <int R>
__attribute__((target("avx2,fma"))) void pv_tile(const float* p, std::int64_t kn, const float* v, std::int64_t ldv,
                                                 float* o, std::int64_t hd) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_loadu_ps(o + r * hd);
    acc[r][1] = _mm256_loadu_ps(o + r * hd + 8);
  }
  for (std::int64_t j = 0; j < kn; ++j) {
    const __m256 v0 = _mm256_loadu_ps(v + j * ldv), v1 = _mm256_loadu_ps(v + j * ldv + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 pv = _mm256_broadcast_ss(p + r * kKeyBlock + j);
      acc[r][0] = _mm256_fmadd_ps(pv, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pv, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(o + r * hd, acc[r][0]);
    _mm256_storeu_ps(o + r * hd + 8, acc[r][1]);
  }
}

// Runs tile<R> over rows [0, M) in groups of 6 (the remainder with a smaller R).
template <template <int> class Tile, typename... A>
__attribute__((target("avx2,fma"))) void over_row_tiles(std::int64_t M, std::int64_t row_step_in,
                                                        std::int64_t row_step_out, const float* in, float* out,
                                                        A... args) {
  std::int64_t r = 0;
  for (; r + 6 <= M; r += 6) Tile<6>::run(in + r * row_step_in, out + r * row_step_out, args...);
  switch (M - r) {
    case 5: Tile<5>::run(in + r * row_step_in, out + r * row_step_out, args...); break;
    case 4: Tile<4>::run(in + r * row_step_in, out + r * row_step_out, args...); break;
    case 3: Tile<3>::run(in + r * row_step_in, out + r * row_step_out, args...); break;
    case 2: Tile<2>::run(in + r * row_step_in, out + r * row_step_out, args...); break;
    case 1: Tile<1>::run(in + r * row_step_in, out + r * row_step_out, args...); break;
    default: break;
  }
}

template <int R>
struct QkTile {
  __attribute__((target("avx2,fma"))) static void run(const float* qp, float* s, std::int64_t hd, const float* kt,
                                                      std::int64_t c) {
    qk_tile<R>(qp, hd, kt, c, s);
  }
};

template <int R>
struct PvTile {
  __attribute__((target("avx2,fma"))) static void run(const float* p, float* o, std::int64_t kn, const float* v,
                                                      std::int64_t ldv, std::int64_t hd) {
    pv_tile<R>(p, kn, v, ldv, o, hd);
  }
};

// The same two tiles with 512-bit vectors where the CPU has AVX-512 (twice the multiply-adds per
// instruction): 16 keys or 16 dimensions in one vector, up to 12 rows. Each output lane is the same
// sum in the same order as the AVX2 tiles', so both give the same bits.
template <int R>
__attribute__((target("avx512f"))) void qk_tile512(const float* qp, std::int64_t hd, const float* kt, std::int64_t c,
                                                   float* s) {
  __m512 acc[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (std::int64_t d = 0; d < hd; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kKeyBlock + c);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qp[r * hd + d]), k0, acc[r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * kKeyBlock + c, acc[r]);
}

template <int R>
__attribute__((target("avx512f"))) void pv_tile512(const float* p, std::int64_t kn, const float* v, std::int64_t ldv,
                                                   float* o, std::int64_t hd) {
  __m512 acc[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r] = _mm512_loadu_ps(o + r * hd);
  for (std::int64_t j = 0; j < kn; ++j) {
    const __m512 v0 = _mm512_loadu_ps(v + j * ldv);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kKeyBlock + j]), v0, acc[r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(o + r * hd, acc[r]);
}

// Rows [0, M) in groups of 12, the remainder with a smaller R: tiles[R] for R = 1..12.
template <typename Fn, typename... A>
void over_row_tiles12(const std::array<Fn, 13>& tiles, std::int64_t M, std::int64_t row_step_in, std::int64_t row_step_out,
                      const float* in, float* out, A... args) {
  for (std::int64_t r = 0; r < M; r += 12) {
    const auto n = static_cast<std::size_t>(std::min<std::int64_t>(12, M - r));
    tiles[n](in + r * row_step_in, out + r * row_step_out, args...);
  }
}

template <std::size_t... I>
constexpr auto qk_tiles512(std::index_sequence<I...>) {
  using Fn = void (*)(const float*, float*, std::int64_t, const float*, std::int64_t);
  return std::array<Fn, 13>{nullptr, [](const float* qp, float* s, std::int64_t hd, const float* kt, std::int64_t c) {
                              qk_tile512<static_cast<int>(I) + 1>(qp, hd, kt, c, s);
                            }...};
}
template <std::size_t... I>
constexpr auto pv_tiles512(std::index_sequence<I...>) {
  using Fn = void (*)(const float*, float*, std::int64_t, const float*, std::int64_t, std::int64_t);
  return std::array<Fn, 13>{nullptr,
                            [](const float* p, float* o, std::int64_t kn, const float* v, std::int64_t ldv, std::int64_t hd) {
                              pv_tile512<static_cast<int>(I) + 1>(p, kn, v, ldv, o, hd);
                            }...};
}
constexpr auto kQk512 = qk_tiles512(std::make_index_sequence<12>{});
constexpr auto kPv512 = pv_tiles512(std::make_index_sequence<12>{});

// Per-thread scratch of one unit.
struct Scratch {
  std::vector<float> q, o, s, kt, m, l;
};

// One unit: KV head j, tokens [t0, t1).
__attribute__((target("avx2,fma"))) void unit(const float* q, std::int64_t ldq, const float* k, const float* v,
                                              std::int64_t ldkv, std::int64_t past, std::int64_t nh,
                                              std::int64_t nkv, std::int64_t hd, std::int64_t j, std::int64_t t0,
                                              std::int64_t t1, float* out, std::int64_t ldo, Scratch& w, bool avx512) {
  const std::int64_t g = nh / nkv;
  const std::int64_t M = (t1 - t0) * g;
  w.q.resize(static_cast<std::size_t>(M * hd));
  w.o.assign(static_cast<std::size_t>(M * hd), 0.0f);
  w.s.resize(static_cast<std::size_t>(M * kKeyBlock));
  w.kt.resize(static_cast<std::size_t>(hd * kKeyBlock));
  w.m.assign(static_cast<std::size_t>(M), -std::numeric_limits<float>::infinity());
  w.l.assign(static_cast<std::size_t>(M), 0.0f);
  // Row r = (t - t0) * g + hh: query head j * g + hh of token t, scaled by 1/sqrt(hd).
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(static_cast<float>(hd)));
  for (std::int64_t t = t0; t < t1; ++t)
    for (std::int64_t hh = 0; hh < g; ++hh) {
      const float* src = q + t * ldq + (j * g + hh) * hd;
      float* dst = w.q.data() + ((t - t0) * g + hh) * hd;
      for (std::int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), scale));
    }
  const float* kh = k + j * hd;
  const float* vh = v + j * hd;
  const std::int64_t kend = past + t1;  // keys the unit's last token sees
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (std::int64_t kb = 0; kb < kend; kb += kKeyBlock) {
    const std::int64_t kn = std::min(kKeyBlock, kend - kb);
    // Kt[d][jj] = K[kb + jj][d]; zero past kn (their scores are masked below).
    float* kt = w.kt.data();
    for (std::int64_t jj = 0; jj < kKeyBlock; ++jj) {
      if (jj < kn) {
        const float* kr = kh + (kb + jj) * ldkv;
        for (std::int64_t d = 0; d < hd; ++d) kt[d * kKeyBlock + jj] = kr[d];
      } else {
        for (std::int64_t d = 0; d < hd; ++d) kt[d * kKeyBlock + jj] = 0.0f;
      }
    }
    const std::int64_t kcols = (kn + 15) / 16 * 16;
    for (std::int64_t c = 0; c < kcols; c += 16) {
      if (avx512) over_row_tiles12(kQk512, M, hd, kKeyBlock, w.q.data(), w.s.data(), hd, kt, c);
      else over_row_tiles<QkTile>(M, hd, kKeyBlock, w.q.data(), w.s.data(), hd, kt, c);
    }
    // Online softmax, row by row.
    for (std::int64_t r = 0; r < M; ++r) {
      const std::int64_t t = t0 + r / g;
      const std::int64_t vis = std::min(kn, past + t + 1 - kb);  // keys of this block row r sees
      float* s = w.s.data() + r * kKeyBlock;
      if (vis <= 0) {
        std::fill(s, s + kKeyBlock, 0.0f);  // nothing seen: no weight
        continue;
      }
      // Mask [vis, 64): -inf, so the vector loops run over whole blocks of 8.
      for (std::int64_t jj = vis; jj < kKeyBlock; ++jj) s[jj] = -std::numeric_limits<float>::infinity();
      __m256 mx = neg_inf;
      for (std::int64_t jj = 0; jj < kKeyBlock; jj += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + jj));
      float bm = -std::numeric_limits<float>::infinity();
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      for (float x : lanes) bm = std::max(bm, x);
      const float m_old = w.m[static_cast<std::size_t>(r)];
      const float m_new = std::max(m_old, bm);
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (std::int64_t jj = 0; jj < kKeyBlock; jj += 8) {
        const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + jj), mv));  // -inf - m -> 0
        _mm256_storeu_ps(s + jj, e);
        sum = _mm256_add_ps(sum, e);
      }
      _mm256_store_ps(lanes, sum);
      float bsum = 0;
      for (float x : lanes) bsum += x;
      if (m_old != m_new && m_old != -std::numeric_limits<float>::infinity()) {
        const float alpha = std::exp(m_old - m_new);
        w.l[static_cast<std::size_t>(r)] *= alpha;
        float* o = w.o.data() + r * hd;
        const __m256 av = _mm256_set1_ps(alpha);
        for (std::int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), av));
      }
      w.m[static_cast<std::size_t>(r)] = m_new;
      w.l[static_cast<std::size_t>(r)] += bsum;
    }
    for (std::int64_t d0 = 0; d0 < hd; d0 += 16) {
      if (avx512) over_row_tiles12(kPv512, M, kKeyBlock, hd, w.s.data(), w.o.data() + d0, kn, vh + kb * ldkv + d0, ldkv, hd);
      else over_row_tiles<PvTile>(M, kKeyBlock, hd, w.s.data(), w.o.data() + d0, kn, vh + kb * ldkv + d0, ldkv, hd);
    }
  }
  for (std::int64_t t = t0; t < t1; ++t)
    for (std::int64_t hh = 0; hh < g; ++hh) {
      const std::int64_t r = (t - t0) * g + hh;
      const float l = w.l[static_cast<std::size_t>(r)];
      const __m256 inv = _mm256_set1_ps(l > 0 ? 1.0f / l : 0.0f);
      const float* o = w.o.data() + r * hd;
      float* dst = out + t * ldo + (j * g + hh) * hd;
      for (std::int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
    }
}
#endif

}  // namespace

bool causal_attention_available(std::int64_t hd) {
#if LS_X86
  return use_avx2() && hd > 0 && hd % 16 == 0;
#else
  (void)hd;
  return false;
#endif
}

void causal_attention(const float* q, std::int64_t ldq, const float* k, const float* v, std::int64_t ldkv,
                      std::int64_t L, std::int64_t past, std::int64_t nh, std::int64_t nkv, std::int64_t hd,
                      float* out, std::int64_t ldo) {
  const AttentionChunk one{q, k, v, out, L, past};
  causal_attention(std::span<const AttentionChunk>(&one, 1), ldq, ldkv, ldo, nh, nkv, hd);
}

void causal_attention(std::span<const AttentionChunk> chunks, std::int64_t ldq, std::int64_t ldkv, std::int64_t ldo,
                      std::int64_t nh, std::int64_t nkv, std::int64_t hd) {
#if LS_X86
  // Every chunk's units in one parallel region: a step that prefills 64 short prompts would
  // otherwise pay 64 regions (and their barriers) per layer.
  struct Unit {
    std::size_t chunk;
    std::int64_t j, t0, t1;
  };
  std::vector<Unit> units;
  for (std::size_t c = 0; c < chunks.size(); ++c)
    for (std::int64_t j = 0; j < nkv; ++j)
      for (std::int64_t t0 = 0; t0 < chunks[c].L; t0 += kQueryBlock)
        units.push_back({c, j, t0, std::min(chunks[c].L, t0 + kQueryBlock)});
  auto cost = [&](std::int64_t u) {
    const Unit& x = units[static_cast<std::size_t>(u)];
    return (chunks[x.chunk].past + x.t1) * (x.t1 - x.t0);
  };
  const bool avx512 = use_avx512();
  parallel_for_cost(static_cast<std::int64_t>(units.size()), cost, [&](std::int64_t u0, std::int64_t u1) {
    thread_local Scratch w;
    for (std::int64_t u = u0; u < u1; ++u) {
      const Unit& x = units[static_cast<std::size_t>(u)];
      const AttentionChunk& c = chunks[x.chunk];
      unit(c.q, ldq, c.k, c.v, ldkv, c.past, nh, nkv, hd, x.j, x.t0, x.t1, c.out, ldo, w, avx512);
    }
  });
#else
  (void)chunks, (void)ldq, (void)ldkv, (void)ldo, (void)nh, (void)nkv, (void)hd;
#endif
}

}  // namespace lorasync::model::cpu
