// core/model/cpu_kernels.h: our fp32 CPU kernels for the decode step (raw pointers, no ATen).
//
// Decode runs a few rows (one per sequence) through every weight matrix once per token, so it is
// bound by streaming the weights from memory and by per-operation overheads, not by GEMM. These
// kernels read each weight matrix once per call for up to a few dozen rows, fuse the small
// elementwise steps (RMSNorm, RoPE, SiLU-gate) into single loops, and read the paged KV cache in
// place (no gathered copy of the context). They vectorise with AVX2+FMA where the CPU has it
// (checked at run time) and fall back to portable loops elsewhere; the numerics are Hugging Face's
// (fp32 accumulation, RMSNorm and softmax in fp32), only the summation order differs.
//
// Work is split over libtorch's intra-op threads (model::set_compute_threads).
// Thread-safety: every function is reentrant; outputs must not alias inputs unless stated.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

namespace lorasync::model::cpu {

// The AVX2+FMA kernels run where the CPU has them, else the portable ones. This forces the
// portable kernels (tests compare both); returns the previous setting.
bool set_force_portable(bool on);

// Where the CPU has AVX-512F, the outer-product kernel (linear_gemm) uses 512-bit tiles; this
// allows or forbids them (A/B runs of `bench forward`, tests of both); returns the previous setting.
bool set_avx512_allowed(bool on);
// Whether linear_gemm runs its AVX-512 tiles now.
bool avx512_in_use();
// The kernels that run now: "avx512", "avx2" or "portable" (logged by serve, reported by the benches).
const char* kernels_name();

// f(begin, end) over contiguous pieces of [0, n) on libtorch's intra-op threads (its OpenMP
// runtime): one piece per thread, run inline for n < 2 or inside another parallel region.
void parallel_for(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& f);

// The same, cut where the running total of cost(i) (>= 0) crosses each thread's equal share:
// parallel_for cuts by count, which gives one thread most of the work when tasks differ in size
// (a linear call's 64 KiB weight chunks next to its LoRA A parts of a few KiB).
void parallel_for_cost(std::int64_t n, const std::function<std::int64_t(std::int64_t)>& cost,
                       const std::function<void(std::int64_t, std::int64_t)>& f);

// One output matrix of a shared-input linear: y[m * ldy + n] = x[m] . w[n] (+ bias[n]),
// w row-major [n_out, K].
struct LinearOut {
  const float* w = nullptr;
  const float* bias = nullptr;  // may be null
  std::int64_t n_out = 0;
  float* y = nullptr;
  std::int64_t ldy = 0;
};

// y = x w^T (+ bias) for every part, x [M, K] with row stride ldx; the parts (q/k/v, gate/up)
// share one parallel region and each weight is read from memory once for all M rows. Up to
// kGemmMinRows - 1 rows (or without AVX2) it is linear_rows, from kGemmMinRows linear_gemm.
void linear(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx,
            std::span<const LinearOut> parts);

// The rows at which linear() switches from dot products to the outer-product kernel. Measured
// with `bench forward` (small preset, 2 threads, decode tok/s, dot products vs outer product):
// 452 vs 306 at 8 rows (the weight stream bounds both), 428 vs 376 at 10, 407 vs 441 at 12,
// 353 vs 681 at 32, 373 vs 686 at 64.
inline constexpr std::int64_t kGemmMinRows = 12;

// The dot-product kernel: each weight row in memory order against every row of x (the weight
// stream is the bound at a few rows). AVX2+FMA or portable.
void linear_rows(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx,
                 std::span<const LinearOut> parts);

// The outer-product kernel (cpu_gemm.cpp): register tiles of 6 weight rows x 16 rows of x over a
// packed copy of x, weights in their natural layout; bound by the FMA units. AVX2+FMA only:
// without it (linear_gemm_available() false) it runs linear_rows.
bool linear_gemm_available();
void linear_gemm(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx,
                 std::span<const LinearOut> parts);

// One adapter's low-rank delta on one output: y[row] += scale * B (A x[row]) for each of its rows,
// A [r, in] and B [out, r] row-major. rows null: rows 0 .. n_rows - 1.
struct LoraDelta {
  const float* A = nullptr;
  const float* B = nullptr;
  std::int64_t r = 0;
  float scale = 1.0f;
  const std::int64_t* rows = nullptr;
  std::int64_t n_rows = 0;
  float* y = nullptr;
  std::int64_t ldy = 0;
  std::int64_t out = 0;
};

// Every delta of a batch's adapters on the outputs that share x [*, in] (row stride ldx), in two
// parallel regions whatever the number of adapters and modules: (A x) * scale for every (delta,
// block of rows; an adapter with kGemmMinRows rows or more gathered onto linear()), then the B
// products into y for every (delta, block of outputs): B read in place for a few rows, transposed
// and four rows at a time for more. Deltas must not write the same element of y (adapters own
// disjoint rows).
void lora_deltas(const float* x, std::int64_t ldx, std::int64_t in, std::span<const LoraDelta> deltas);

// One adapter's B product on one module's output, its A product already computed for its rows:
// y[row] += scale * B t[row] for each of its rows, t[row] = A x[row] (r values at t + row * ldt,
// unscaled), B [out, r] row-major. rows null: rows 0 .. n_rows - 1.
struct LoraBUpdate {
  const float* t = nullptr;
  std::int64_t ldt = 0;
  const float* B = nullptr;
  std::int64_t r = 0;
  float scale = 1.0f;
  const std::int64_t* rows = nullptr;
  std::int64_t n_rows = 0;
  float* y = nullptr;
  std::int64_t ldy = 0;
  std::int64_t out = 0;
};

// Every update, on the calling thread when the whole is below kLoraSerialMacs multiply-adds (a
// decode step's: a parallel region would cost more than the work), else in one parallel region
// over (update, row) tasks. Updates must not write the same element of y.
inline constexpr std::int64_t kLoraSerialMacs = std::int64_t{1} << 20;
void lora_b_updates(std::span<const LoraBUpdate> updates);

// out[m] = w * (x[m] * rsqrt(mean(x[m]^2) + eps)), rows of d (out may equal x).
void rms_norm(const float* x, const float* w, float eps, std::int64_t M, std::int64_t d, float* out);

// In place on x [M, heads, hd] (row stride ld): rotate-half RoPE at positions[m] with
// inv_freq [hd / 2] (angle computed in fp32 as Hugging Face does).
void rope(float* x, std::int64_t M, std::int64_t ld, std::int64_t heads, std::int64_t hd,
          const std::int64_t* positions, const float* inv_freq);

// out[i] = silu(gate[i]) * up[i], n elements (out may equal gate).
void silu_mul(const float* gate, const float* up, std::int64_t n, float* out);

// One query token per sequence against its cached keys, read in place from the pool.
//   q, out [*, nh * hd]: sequence b's query and output are row rows[b] (rows null: row b);
//   k_pool / v_pool [n_slots, nkv, hd]; sequence b attends to the slots slots[b][0 .. lens[b]) in
//   order. Query head i uses KV head i / (nh / nkv).
void decode_attention(const float* q, const float* k_pool, const float* v_pool, std::int64_t nh,
                      std::int64_t nkv, std::int64_t hd, std::int64_t B, const std::int64_t* rows,
                      const std::int64_t* const* slots, const std::int64_t* lens, float* out);

// Causal attention of one sequence's chunk of L new tokens (a prefill chunk), cpu_attention.cpp:
//   q [L, nh * hd] with row stride ldq; k, v [past + L, nkv * hd] with row stride ldkv (the cached
//   context, then the chunk's own keys); out [L, nh * hd] with row stride ldo. Query i sees keys
//   j <= past + i; query head h uses KV head h / (nh / nkv); scale 1/sqrt(hd), softmax in fp32.
// Blocked with an online softmax (the [L, S] scores never exist), only the key blocks a query
// block sees, the g query heads of a KV head sharing each key block. AVX2 + FMA and hd a multiple
// of 16 only (causal_attention_available); callers take libtorch's attention otherwise.
bool causal_attention_available(std::int64_t hd);
void causal_attention(const float* q, std::int64_t ldq, const float* k, const float* v, std::int64_t ldkv,
                      std::int64_t L, std::int64_t past, std::int64_t nh, std::int64_t nkv, std::int64_t hd,
                      float* out, std::int64_t ldo);
// Several chunks (a step's prefill segments) in one parallel region; chunk c's pointers as above,
// the strides and head shapes shared.
struct AttentionChunk {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* out = nullptr;
  std::int64_t L = 0, past = 0;
};
void causal_attention(std::span<const AttentionChunk> chunks, std::int64_t ldq, std::int64_t ldkv, std::int64_t ldo,
                      std::int64_t nh, std::int64_t nkv, std::int64_t hd);

// Softmax statistics of one row z = x / t (t > 0), for the sampler:
//   returns max z, and with it row_exp_blocks gives e[i] = exp(z[i] - shift) (e may be null) and
//   per-block sums of e in double, block_sums[j] over [j * block, (j + 1) * block); returns their
//   total. Exponentials are vectorised (relative error ~1e-7), exactly 0 below e^-87.
float row_max(const float* x, std::int64_t n, float t);
double row_exp_blocks(const float* x, std::int64_t n, float t, float shift, float* e,
                      double* block_sums, std::int64_t block);

}  // namespace lorasync::model::cpu
