// core/model/cuda/lora_batched.cu: the LoRA deltas of several adapters in one batch, one launch
// per projection: y[row] += scale_a * B_a (A_a x[row]) for the adapter a of each row.
//
// The unfused path runs, per adapter and per projection, a gather of its rows, two small matmuls, a
// scale and a scatter-add: five launches per adapter, so five adapters over 28 layers and 7
// projections is about 5,000 launches per decode step, more than the base model's own. Here one
// launch per projection covers every adapter.
//
// Rows are grouped into tiles (host side, once per forward: LoraBatch): a tile is up to kTileRows
// rows of one adapter. Grid: (tile, column block). A block first computes its tile's z = A x for
// every row of the tile into shared memory (each warp one rank component at a time; its lanes
// stride over the input, one load of A serving every row of the tile), then each thread takes
// output columns j and reads B[j, :] once for all the tile's rows. So A and B are read once per
// tile (and A once per column block), not once per row.
//
// Shapes: x [T, in], y [T, out] (row strides x_ld, y_ld), contiguous rows; per adapter slot A [r, in]
// and B [out, r] row-major, r <= kMaxRank. x and y share one dtype, every A and B another (fp32,
// bf16, fp16). z and the update accumulate in fp32; y is rounded once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/model/cuda/elem.cuh"
#include "core/model/cuda/launch.h"

namespace lorasync::model::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = kLoraTileRows;

template <typename TX, typename TW>
__global__ void __launch_bounds__(kThreads) lora_tiles_kernel(LoraTilesArgs a) {
  const int* tile = a.tiles + static_cast<std::int64_t>(blockIdx.x) * (2 + kRows);
  const int slot = tile[0], count = tile[1];
  const int rank = a.rank[slot];
  if (rank == 0 || count == 0) return;  // this adapter does not target the projection
  const TW* A = static_cast<const TW*>(a.A[slot]);
  const TW* B = static_cast<const TW*>(a.B[slot]);
  const TX* x = static_cast<const TX*>(a.x);
  TX* y = static_cast<TX*>(a.y);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  __shared__ int rows[kRows];
  __shared__ float z[kRows][kLoraMaxRank];
  if (threadIdx.x < kRows) rows[threadIdx.x] = threadIdx.x < count ? tile[2 + threadIdx.x] : 0;
  __syncthreads();

  // z[i][r] = A[r, :] . x[rows[i], :]
  for (int r = warp; r < rank; r += kWarps) {
    float acc[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) acc[i] = 0.f;
    const TW* ar = A + static_cast<std::int64_t>(r) * a.in;
    for (std::int64_t k = lane; k < a.in; k += 32) {
      const float w = to_f32(ar[k]);
#pragma unroll
      for (int i = 0; i < kRows; ++i)
        if (i < count) acc[i] += w * to_f32(x[rows[i] * a.x_ld + k]);
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      float s = acc[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) z[i][r] = s;
    }
  }
  __syncthreads();

  // y[rows[i], j] += scale * B[j, :] . z[i, :] for this block's columns.
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.y) * a.cols_per_block;
  const std::int64_t j1 = j0 + a.cols_per_block < a.out ? j0 + a.cols_per_block : a.out;
  const float scale = a.scale[slot];
  for (std::int64_t j = j0 + threadIdx.x; j < j1; j += kThreads) {
    float acc[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) acc[i] = 0.f;
    const TW* br = B + j * rank;
    for (int r = 0; r < rank; ++r) {
      const float w = to_f32(br[r]);
#pragma unroll
      for (int i = 0; i < kRows; ++i) acc[i] += w * z[i][r];
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      if (i < count) {
        TX* yp = y + rows[i] * a.y_ld + j;
        *yp = from_f32<TX>(to_f32(*yp) + scale * acc[i]);
      }
  }
}

template <typename TX>
int launch_x(const LoraTilesArgs& a, ElemType wtype, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(a.n_tiles),
                  static_cast<unsigned>((a.out + a.cols_per_block - 1) / a.cols_per_block));
  switch (wtype) {
    case ElemType::kF32: lora_tiles_kernel<TX, float><<<grid, kThreads, 0, s>>>(a); break;
    case ElemType::kBF16: lora_tiles_kernel<TX, __nv_bfloat16><<<grid, kThreads, 0, s>>>(a); break;
    case ElemType::kF16: lora_tiles_kernel<TX, __half><<<grid, kThreads, 0, s>>>(a); break;
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_lora_tiles(const LoraTilesArgs& args, ElemType xtype, ElemType wtype, void* stream) {
  if (args.n_tiles == 0 || args.out == 0) return 0;
  if (args.cols_per_block <= 0) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  switch (xtype) {
    case ElemType::kF32: return launch_x<float>(args, wtype, s);
    case ElemType::kBF16: return launch_x<__nv_bfloat16>(args, wtype, s);
    case ElemType::kF16: return launch_x<__half>(args, wtype, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace lorasync::model::cuda
