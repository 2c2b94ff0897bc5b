// core/model/cpu_gemm.cpp: cpu::linear_gemm, the outer-product kernel behind cpu::linear for a few
// dozen rows and more (decode at batch 16-256, the LM head of those steps).
//
// The weights stay in their natural layout, w [N, K] row-major, so nothing is packed at load and no
// second copy of the model exists. The transposed problem y^T = w x^T is computed instead: a
// register tile holds R weight rows x 16 rows of x, and each k step broadcasts R weight scalars
// (one sequential stream per weight row) against two vectors of a packed panel of x (x^T, 16 rows
// of x side by side, made once per call and read from cache). Every weight element is loaded once
// per panel and used in 16 multiply-adds, so the kernel is bound by the FMA units, not by memory;
// the packing costs M x K copies, noise beside the M x K x N multiply-adds.
//
// Where the CPU has AVX-512 (checked at run time, cpu::set_avx512_allowed can forbid it) the tile is
// 12 weight rows x two panels (32 rows of x, one 512-bit vector per panel): 24 accumulators, each
// broadcast weight used in two multiply-adds. Zen 5 and recent Intel cores execute two 512-bit
// FMAs per cycle, twice the AVX2 rate (measured here: 244 against 122 GFLOP/s per core). Each
// output is still one lane's sum over k in order, so both tiles give the same bits.
#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>
#include <vector>

#include "core/model/cpu_kernels.h"

#include "core/model/cpu_kernels_impl.h"

namespace lorasync::model::cpu {

namespace {

constexpr int kPanel = 16;  // rows of x per packed panel: two AVX2 vectors
constexpr int kTileN = 6;   // weight rows per register tile: 6 x 2 accumulators + 2 x + 1 broadcast
// Rows of x per pass over the weights: a block's panels (64 x K floats) stay in L2 while every
// weight tile is read once from memory and then from L1/L2 for the block's other panels.
constexpr std::int64_t kBlockRows = 64;
// Rows of x packed and multiplied per pass over all the weights: bounds the packed copy (512 x K
// floats: 18 MB at K = 8,960) when the fast path sends thousands of prefill rows here.
constexpr std::int64_t kPassRows = 512;

// Panel p of x: xp[k][16] = x[16 p + j][k] for rows 16 p + j < M, 0 beyond (the padding's products
// are computed and never stored). Written in order, read from 16 rows at once (16 streams).
void pack_panel(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, std::int64_t p, float* xp) {
  const std::int64_t r = std::min<std::int64_t>(kPanel, M - p * kPanel);
  const float* src[kPanel];
  for (std::int64_t j = 0; j < r; ++j) src[j] = x + (p * kPanel + j) * ldx;
  for (std::int64_t k = 0; k < K; ++k) {
    float* dst = xp + k * kPanel;
    std::int64_t j = 0;
    for (; j < r; ++j) dst[j] = src[j][k];
    for (; j < kPanel; ++j) dst[j] = 0.0f;
  }
}

#if LS_X86
// out[i][j] = w[i] . x_j for R weight rows (row stride K) and the 16 rows j of one packed panel.
template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* xp, const float* w, std::int64_t K,
                                                   float* out) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
  for (std::int64_t k = 0; k < K; ++k) {
    const __m256 x0 = _mm256_loadu_ps(xp + k * kPanel), x1 = _mm256_loadu_ps(xp + k * kPanel + 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 b = _mm256_broadcast_ss(w + i * K + k);
      a0[i] = _mm256_fmadd_ps(b, x0, a0[i]);
      a1[i] = _mm256_fmadd_ps(b, x1, a1[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(out + i * kPanel, a0[i]);
    _mm256_storeu_ps(out + i * kPanel + 8, a1[i]);
  }
}

// out[p][i][j] = w[i] . x_j for R weight rows and the 16 rows j of each of P consecutive packed
// panels (P = 1 or 2): R x P accumulators of 16 lanes.
constexpr int kTileN512 = 12;
template <int R, int P>
__attribute__((target("avx512f"))) void tile_avx512(const float* xp, const float* w, std::int64_t K,
                                                    float* out) {
  __m512 a[P][R];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) a[q][i] = _mm512_setzero_ps();
  const float* x1 = xp + K * kPanel;
  for (std::int64_t k = 0; k < K; ++k) {
    const __m512 x0 = _mm512_loadu_ps(xp + k * kPanel);
    const __m512 xq = P == 2 ? _mm512_loadu_ps(x1 + k * kPanel) : x0;
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const __m512 b = _mm512_set1_ps(w[i * K + k]);
      a[0][i] = _mm512_fmadd_ps(b, x0, a[0][i]);
      if constexpr (P == 2) a[P - 1][i] = _mm512_fmadd_ps(b, xq, a[P - 1][i]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) _mm512_storeu_ps(out + (q * kTileN512 + i) * kPanel, a[q][i]);
}

// The tile output o (R <= 12 rows of 16 lanes, row i at o + i * kPanel: output n + i of x rows
// 0..15) into y: the 16 x 16 block (rows past R as zeros) transposed in registers, then rows
// j < r of x get their R outputs plus bias by one masked store each (the scalar loop of 12 x 16
// loads, adds and stores was 4-6 % of a batch-64 decode step).
// g++ 12's unpack intrinsics pass _mm512_undefined_ps() as their unused merge source, which
// -Wmaybe-uninitialized reports once inlined here: a false positive of the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
__attribute__((target("avx512f"))) void store_transposed512(const float* o, int R, const float* bias, std::int64_t r,
                                                            float* y, std::int64_t ldy) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = i < R ? _mm512_load_ps(o + i * kPanel) : _mm512_setzero_ps();
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(a[i], a[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(a[i], a[i + 1]);
  }
  // Per group g of four rows (4g..4g+3): u[4g + c] holds, in 128-bit lane l, column 4l + c of those rows.
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    const __m512 lo0 = t[4 * g], hi0 = t[4 * g + 1], lo1 = t[4 * g + 2], hi1 = t[4 * g + 3];
    u[4 * g + 0] = _mm512_shuffle_ps(lo0, lo1, 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(lo0, lo1, 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(hi0, hi1, 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(hi0, hi1, 0xEE);
  }
  const __m512 bv = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << R) - 1), bias);
  const auto mask = static_cast<__mmask16>((1u << R) - 1);
  for (int c = 0; c < 4; ++c) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88), w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    const __m512 col[4] = {_mm512_shuffle_f32x4(v0, w0, 0x88), _mm512_shuffle_f32x4(v1, w1, 0x88),
                           _mm512_shuffle_f32x4(v0, w0, 0xDD), _mm512_shuffle_f32x4(v1, w1, 0xDD)};
    for (int l = 0; l < 4; ++l) {
      const std::int64_t j = 4 * l + c;  // col[l] is x row c + 4 l
      if (j < r) _mm512_mask_storeu_ps(y + j * ldy, mask, _mm512_add_ps(col[l], bv));
    }
  }
}
#pragma GCC diagnostic pop

using TileFn = void (*)(const float*, const float*, std::int64_t, float*);
constexpr TileFn kTiles[kTileN + 1] = {nullptr,         tile_avx2<1>, tile_avx2<2>, tile_avx2<3>,
                                       tile_avx2<4>,    tile_avx2<5>, tile_avx2<6>};

template <int P, std::size_t... I>
constexpr std::array<TileFn, kTileN512 + 1> tiles512(std::index_sequence<I...>) {
  return {nullptr, tile_avx512<static_cast<int>(I) + 1, P>...};
}
constexpr auto kTiles512x1 = tiles512<1>(std::make_index_sequence<kTileN512>{});
constexpr auto kTiles512x2 = tiles512<2>(std::make_index_sequence<kTileN512>{});

// Weight rows [n0, n1) of one part against the block's packed rows [m0, m0 + rows).
void rows_block(const float* xp, std::int64_t rows, std::int64_t m0, std::int64_t K, const LinearOut& p,
                std::int64_t n0, std::int64_t n1, bool avx512) {
  alignas(64) float out[2 * kTileN512 * kPanel];
  const std::int64_t panels = (rows + kPanel - 1) / kPanel;
  const int tile_n = avx512 ? kTileN512 : kTileN;
  for (std::int64_t n = n0; n < n1; n += tile_n) {
    const int R = static_cast<int>(std::min<std::int64_t>(tile_n, n1 - n));
    float bias[16] = {};  // 16: the AVX-512 store loads it as one vector (lanes past R masked)
    if (p.bias != nullptr)
      for (int i = 0; i < R; ++i) bias[i] = p.bias[n + i];
    if (avx512) {
      std::int64_t pi = 0;
      auto store512 = [&](std::int64_t q, const float* o) {
        store_transposed512(o, R, bias, std::min<std::int64_t>(kPanel, rows - q * kPanel),
                            p.y + (m0 + q * kPanel) * p.ldy + n, p.ldy);
      };
      for (; pi + 2 <= panels; pi += 2) {
        kTiles512x2[static_cast<std::size_t>(R)](xp + pi * K * kPanel, p.w + n * K, K, out);
        store512(pi, out);
        store512(pi + 1, out + kTileN512 * kPanel);
      }
      if (pi < panels) {
        kTiles512x1[static_cast<std::size_t>(R)](xp + pi * K * kPanel, p.w + n * K, K, out);
        store512(pi, out);
      }
      continue;
    }
    for (std::int64_t pi = 0; pi < panels; ++pi) {
      kTiles[R](xp + pi * K * kPanel, p.w + n * K, K, out);
      const std::int64_t r = std::min<std::int64_t>(kPanel, rows - pi * kPanel);
      for (std::int64_t j = 0; j < r; ++j) {
        float* y = p.y + (m0 + pi * kPanel + j) * p.ldy + n;
        for (int i = 0; i < R; ++i) y[i] = out[i * kPanel + j] + bias[i];
      }
    }
  }
}
#endif

}  // namespace

void linear_gemm(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx,
                 std::span<const LinearOut> parts) {
#if LS_X86
  if (M <= 0) return;
  if (!linear_gemm_available() || K <= 0) return linear_rows(x, M, K, ldx, parts);
  // Chunks of whole tiles, >= 64 KiB of weights each, so the threads balance and a chunk's
  // start-up is noise.
  const bool avx512 = detail::use_avx512();
  const std::int64_t tile_n = avx512 ? kTileN512 : kTileN;
  const auto chunks =
      detail::weight_chunks(parts, std::max<std::int64_t>(tile_n, (16384 / K + tile_n - 1) / tile_n * tile_n));
  // Passes of up to 512 rows: every panel of the pass's rows packed first (in parallel), into a
  // buffer this thread reuses (at most 512 x K floats, whatever M); then one region over (block of
  // 64 rows, chunk of weight rows) tasks, block-major: at decode sizes (one block) the threads
  // split the weights, at prefill sizes mostly the blocks.
  thread_local std::vector<float> xp;
  const auto n_chunks = static_cast<std::int64_t>(chunks.size());
  for (std::int64_t base = 0; base < M; base += kPassRows) {
    const std::int64_t rows = std::min(kPassRows, M - base);
    const float* xb = x + base * ldx;
    const std::int64_t panels = (rows + kPanel - 1) / kPanel;
    xp.resize(static_cast<std::size_t>(panels * K * kPanel));
    float* packed = xp.data();
    parallel_for(panels, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t p = b; p < e; ++p) pack_panel(xb, ldx, rows, K, p, packed + p * K * kPanel);
    });
    const std::int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
    // Cut by work (rows of x times weight rows): the chunks differ in size where a part is small.
    auto work = [&](std::int64_t t) {
      const detail::Chunk& ch = chunks[static_cast<std::size_t>(t % n_chunks)];
      return std::min(kBlockRows, rows - (t / n_chunks) * kBlockRows) * (ch.n1 - ch.n0);
    };
    parallel_for_cost(blocks * n_chunks, work, [&](std::int64_t b, std::int64_t e) {
      for (std::int64_t t = b; t < e; ++t) {
        const std::int64_t m0 = (t / n_chunks) * kBlockRows;  // within the pass
        const detail::Chunk& ch = chunks[static_cast<std::size_t>(t % n_chunks)];
        rows_block(packed + (m0 / kPanel) * K * kPanel, std::min(kBlockRows, rows - m0), base + m0, K,
                   parts[ch.part], ch.n0, ch.n1, avx512);
      }
    });
  }
#else
  linear_rows(x, M, K, ldx, parts);
#endif
}

}  // namespace lorasync::model::cpu
