#include "core/model/cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "core/model/cpu_kernels_impl.h"

namespace lorasync::model::cpu {

using namespace detail;  // the helpers shared with cpu_rowops.cpp

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

bool cpu_has_avx512() {
#if LS_X86
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

std::atomic<bool> g_avx512_allowed{true};

}  // namespace
namespace detail {
bool use_avx2() { return cpu_has_avx2() && !g_force_portable.load(std::memory_order_relaxed); }
bool use_avx512() { return use_avx2() && cpu_has_avx512() && g_avx512_allowed.load(std::memory_order_relaxed); }
}  // namespace detail
namespace {

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
#pragma GCC diagnostic pop

}  // namespace
namespace detail {
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
}  // namespace detail
namespace {

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

// The same with 512-bit vectors (K unrolled by 32): half the instructions per weight row, for the
// few-row steps whose weight stream is not yet the bound (decode at batch 2-11).
// g++ 12's _mm512_reduce_add_ps extracts a half through _mm512_extractf64x4_pd, whose header passes
// an undefined merge source that -Wuninitialized reports once inlined here: a false positive of the
// header (as in cpu_gemm.cpp's transposed store).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int MR>
__attribute__((target("avx512f"))) void row_avx512(const float* x, std::int64_t ldx, const float* w,
                                                  std::int64_t K, float* y, std::int64_t ldy, float bias) {
  __m512 a0[MR], a1[MR];
  for (int i = 0; i < MR; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
  std::int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
    for (int i = 0; i < MR; ++i) {
      a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k), w0, a0[i]);
      a1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k + 16), w1, a1[i]);
    }
  }
  for (; k + 16 <= K; k += 16) {
    const __m512 w0 = _mm512_loadu_ps(w + k);
    for (int i = 0; i < MR; ++i) a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k), w0, a0[i]);
  }
  for (int i = 0; i < MR; ++i) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
    for (std::int64_t kk = k; kk < K; ++kk) s += x[i * ldx + kk] * w[kk];
    y[i * ldy] = s + bias;
  }
}
#pragma GCC diagnostic pop

}  // namespace
namespace detail {
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

__attribute__((target("avx2,fma"))) void axpy_avx2(float a, const float* x, float* y, std::int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}
}  // namespace detail
namespace {

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

#endif

using RowFn = void (*)(const float*, std::int64_t, const float*, std::int64_t, float*, std::int64_t, float);

// Rows [n0, n1) of one weight matrix against all M rows of x, weight rows in memory order; rows
// of x four at a time (the weight row is read from memory once, from L1 for the other groups).
void rows_range(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx, const LinearOut& p,
                std::int64_t n0, std::int64_t n1, bool avx, bool avx512) {
  RowFn r1 = row_portable<1>, r2 = row_portable<2>, r4 = row_portable<4>;
#if LS_X86
  if (avx512) {
    r1 = row1_avx2;  // a single row is bound by the weight stream: 512-bit loads measured no faster
    r2 = row_avx512<2>;
    r4 = row_avx512<4>;
  } else if (avx) {
    r1 = row1_avx2;
    r2 = row_avx2<2>;
    r4 = row_avx2<4>;
  }
#endif
  (void)avx, (void)avx512;
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
bool set_avx512_allowed(bool on) { return g_avx512_allowed.exchange(on); }
bool avx512_in_use() { return detail::use_avx512(); }
const char* kernels_name() { return detail::use_avx512() ? "avx512" : detail::use_avx2() ? "avx2" : "portable"; }

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
  const bool avx = use_avx2(), avx512 = use_avx512();
  auto rows_of = [&](std::int64_t c) { return chunks[static_cast<std::size_t>(c)].n1 - chunks[static_cast<std::size_t>(c)].n0; };
  parallel_for_cost(static_cast<std::int64_t>(chunks.size()), rows_of, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t c = b; c < e; ++c) {
      const Chunk& ch = chunks[static_cast<std::size_t>(c)];
      rows_range(x, M, K, ldx, parts[ch.part], ch.n0, ch.n1, avx, avx512);
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
  const bool avx = use_avx2(), avx512 = use_avx512();
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
      rows_range(xs.data(), n, in, in, LinearOut{dl.A, nullptr, dl.r, tt, dl.r}, 0, dl.r, avx, avx512);
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

}  // namespace lorasync::model::cpu
