// core/model/cuda/paged_attention.cu: decode attention reading the paged KV pool in place.
//
// One query token per sequence (the decode step) against that sequence's cached keys and values,
// which sit anywhere in the pool: sequence b attends to the slots slots[b][0 .. lens[b]) in order.
// Nothing is gathered: the unfused path copies every sequence's keys and values into a padded
// [B, Lmax] block first (index_select) and then runs two batched matmuls over the padding too.
//
// Shapes (all contiguous): q [B, nh, hd]; k_pool, v_pool [n_slots, nkv, hd]; slots int64
// [B, slots_ld]; lens int64 [B]; out [B, nh * hd]. q, pools and out share one dtype (fp32, bf16,
// fp16); scores, softmax and the weighted sum accumulate in fp32. Query head i reads KV head
// i / g (g = nh / nkv, grouped-query attention), g <= 8 and hd <= 256 (Qwen2 families: g 5-8,
// hd 64 or 128).
//
// Launch: a block of 4 warps per (sequence, KV head, chunk of keys). Each warp takes every 4th key
// of the chunk: its 32 lanes load the key's and the value's hd elements (consecutive lanes,
// consecutive addresses), each lane holding hd/32 of them; the g query heads of the group share
// those loads (a key is read once per group, not once per head). The dot products reduce by warp
// shuffles and each warp keeps an online softmax (running max, sum, weighted values) per head.
// The block merges its 4 warps through shared memory. Long contexts are split across blocks
// ("flash decoding") so that a batch of one still spreads over the SMs: each chunk writes its
// (max, sum, values) to a workspace and a second kernel merges the chunks of each head.
// Roofline: memory-bound; bytes per call ~ sum(lens) * nkv * hd * 2 * sizeof(T) (+ q and out).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/model/cuda/elem.cuh"
#include "core/model/cuda/launch.h"

namespace lorasync::model::cuda {

namespace {

constexpr int kWarps = 4;
constexpr int kMaxGroup = 8;
constexpr float kNegInf = -INFINITY;


// VEC = elements of a head each lane holds (hd <= 32 * VEC).
template <typename T, int VEC>
__global__ void __launch_bounds__(kWarps * 32) paged_decode_kernel(PagedDecodeArgs p) {
  const std::int64_t b = blockIdx.x, kvh = blockIdx.y, c = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = static_cast<int>(p.nh / p.nkv);
  const std::int64_t hd = p.hd;
  const std::int64_t len = p.lens[b];
  const std::int64_t begin = c * p.chunk;
  const std::int64_t end = begin + p.chunk < len ? begin + p.chunk : len;

  const T* q = static_cast<const T*>(p.q) + (b * p.nh + kvh * g) * hd;
  float qr[kMaxGroup][VEC];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h)
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const std::int64_t d = lane * VEC + v;
      qr[h][v] = (h < g && d < hd) ? to_f32(q[h * hd + d]) * p.scale : 0.f;
    }
  float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][VEC];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    m[h] = kNegInf;
    l[h] = 0.f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[h][v] = 0.f;
  }

  const T* kbase = static_cast<const T*>(p.k_pool);
  const T* vbase = static_cast<const T*>(p.v_pool);
  const std::int64_t* slots = p.slots + b * p.slots_ld;
  for (std::int64_t j = begin + warp; j < end; j += kWarps) {
    const std::int64_t off = (slots[j] * p.nkv + kvh) * hd;
    float kr[VEC], vr[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const std::int64_t d = lane * VEC + v;
      kr[v] = d < hd ? to_f32(kbase[off + d]) : 0.f;
      vr[v] = d < hd ? to_f32(vbase[off + d]) : 0.f;
    }
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      if (h >= g) break;
      float s = 0.f;
#pragma unroll
      for (int v = 0; v < VEC; ++v) s += qr[h][v] * kr[v];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const float m_new = fmaxf(m[h], s);
      const float corr = __expf(m[h] - m_new);  // 0 while m is -inf
      const float e = __expf(s - m_new);
      l[h] = l[h] * corr + e;
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[h][v] = acc[h][v] * corr + e * vr[v];
      m[h] = m_new;
    }
  }

  // Merge the warps: each keeps (m, l, acc) per head in shared memory.
  __shared__ float sm_m[kWarps][kMaxGroup], sm_l[kWarps][kMaxGroup];
  __shared__ float sm_acc[kWarps][kMaxGroup][32 * VEC];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    if (lane == 0) {
      sm_m[warp][h] = m[h];
      sm_l[warp][h] = l[h];
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) sm_acc[warp][h][lane * VEC + v] = acc[h][v];
  }
  __syncthreads();
  const std::int64_t items = static_cast<std::int64_t>(g) * hd;
  for (std::int64_t i = threadIdx.x; i < items; i += kWarps * 32) {
    const int h = static_cast<int>(i / hd);
    const int d = static_cast<int>(i % hd);
    float M = kNegInf;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w][h]);
    float L = 0.f, A = 0.f;
    if (M != kNegInf) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        if (sm_m[w][h] == kNegInf) continue;
        const float f = __expf(sm_m[w][h] - M);
        L += sm_l[w][h] * f;
        A += sm_acc[w][h][d] * f;
      }
    }
    if (p.n_chunks == 1) {
      T* out = static_cast<T*>(p.out) + (b * p.nh + kvh * g + h) * hd;
      out[d] = from_f32<T>(L > 0.f ? A / L : 0.f);  // a sequence without keys reads zeros
    } else {
      const std::int64_t cell = ((b * p.nkv + kvh) * p.n_chunks + c) * g + h;
      p.ws_acc[cell * hd + d] = A;
      if (d == 0) {
        p.ws_m[cell] = M;
        p.ws_l[cell] = L;
      }
    }
  }
}

// Merges the chunks of one (sequence, query head): grid (B, nh), one thread per element of hd.
template <typename T>
__global__ void paged_decode_merge_kernel(PagedDecodeArgs p) {
  const std::int64_t b = blockIdx.x, head = blockIdx.y;
  const std::int64_t g = p.nh / p.nkv, kvh = head / g, h = head % g;
  const std::int64_t base = (b * p.nkv + kvh) * p.n_chunks * g + h;  // cell of chunk 0
  float M = kNegInf;
  for (std::int64_t c = 0; c < p.n_chunks; ++c) M = fmaxf(M, p.ws_m[base + c * g]);
  for (std::int64_t d = threadIdx.x; d < p.hd; d += blockDim.x) {
    float L = 0.f, A = 0.f;
    if (M != kNegInf)
      for (std::int64_t c = 0; c < p.n_chunks; ++c) {
        const std::int64_t cell = base + c * g;
        const float mc = p.ws_m[cell];
        if (mc == kNegInf) continue;
        const float f = __expf(mc - M);
        L += p.ws_l[cell] * f;
        A += p.ws_acc[cell * p.hd + d] * f;
      }
    static_cast<T*>(p.out)[(b * p.nh + head) * p.hd + d] = from_f32<T>(L > 0.f ? A / L : 0.f);
  }
}

template <typename T, int VEC>
void launch_typed(const PagedDecodeArgs& p, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(p.B), static_cast<unsigned>(p.nkv), static_cast<unsigned>(p.n_chunks));
  paged_decode_kernel<T, VEC><<<grid, kWarps * 32, 0, s>>>(p);
  if (p.n_chunks > 1) {
    const unsigned threads = p.hd < 32 ? 32u : static_cast<unsigned>(p.hd);
    paged_decode_merge_kernel<T><<<dim3(static_cast<unsigned>(p.B), static_cast<unsigned>(p.nh)), threads, 0, s>>>(p);
  }
}

template <typename T>
int launch_for_hd(const PagedDecodeArgs& p, cudaStream_t s) {
  if (p.hd <= 32) launch_typed<T, 1>(p, s);
  else if (p.hd <= 64) launch_typed<T, 2>(p, s);
  else if (p.hd <= 128) launch_typed<T, 4>(p, s);
  else launch_typed<T, 8>(p, s);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool paged_decode_fits(std::int64_t nh, std::int64_t nkv, std::int64_t hd) {
  return nkv > 0 && nh % nkv == 0 && nh / nkv <= kMaxGroup && hd > 0 && hd <= 256;
}

int launch_paged_decode_attention(const PagedDecodeArgs& a, ElemType type, void* stream) {
  if (a.B == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case ElemType::kF32: return launch_for_hd<float>(a, s);
    case ElemType::kBF16: return launch_for_hd<__nv_bfloat16>(a, s);
    case ElemType::kF16: return launch_for_hd<__half>(a, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace lorasync::model::cuda
