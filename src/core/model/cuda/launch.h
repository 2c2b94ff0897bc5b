// core/model/cuda/launch.h: raw launchers of our CUDA kernels (compiled by nvcc in the `cuda`
// preset only). No CUDA or libtorch header here: the glue in kernels.cpp checks tensors and calls
// these with device pointers and the current stream (a cudaStream_t passed as void*).
// Each returns the cudaError_t of the launch (0 = success).
#pragma once

#include <cstdint>

namespace lorasync::model::cuda {

enum class ElemType { kF32, kBF16, kF16 };

// See rms_norm.cu: x, y [rows, d], w [d], all of `type`, contiguous, on the stream's device.
int launch_rms_norm(const void* x, const void* w, void* y, std::int64_t rows, std::int64_t d,
                    float eps, ElemType type, void* stream);

// See paged_attention.cu: decode attention over the paged KV pool, read in place. Pointers are
// device pointers; q [B, nh, hd], pools [n_slots, nkv, hd] and out [B, nh * hd] of `type`;
// slots int64 [B, slots_ld], lens int64 [B]. With n_chunks > 1 the keys of each sequence are
// split into chunks of `chunk` and ws_m, ws_l [B * nkv * n_chunks * g] and ws_acc [... * hd]
// (fp32) hold each chunk's partial softmax.
struct PagedDecodeArgs {
  const void* q;
  const void* k_pool;
  const void* v_pool;
  const std::int64_t* slots;
  const std::int64_t* lens;
  void* out;
  float* ws_m;
  float* ws_l;
  float* ws_acc;
  std::int64_t B, nh, nkv, hd, slots_ld, n_chunks, chunk;
  float scale;
};
bool paged_decode_fits(std::int64_t nh, std::int64_t nkv, std::int64_t hd);
int launch_paged_decode_attention(const PagedDecodeArgs& args, ElemType type, void* stream);

// See lora_batched.cu: y[row] += scale * B (A x[row]) with each row's adapter, one launch for all
// adapters. tiles: int32 [n_tiles, 2 + kLoraTileRows] on the device, each (slot, count, rows...),
// the rows of one adapter slot (LoraBatch builds them). Slots whose adapter does not target the
// projection have rank 0. Passed by value: no copy of the pointer table per call.
constexpr int kLoraTileRows = 16;
constexpr int kLoraMaxRank = 64;
constexpr int kLoraMaxSlots = 32;
struct LoraTilesArgs {
  const void* x;
  void* y;
  std::int64_t in, out, x_ld, y_ld;
  const int* tiles;
  std::int64_t n_tiles, cols_per_block;
  const void* A[kLoraMaxSlots];
  const void* B[kLoraMaxSlots];
  int rank[kLoraMaxSlots];
  float scale[kLoraMaxSlots];
};
int launch_lora_tiles(const LoraTilesArgs& args, ElemType xtype, ElemType wtype, void* stream);

}  // namespace lorasync::model::cuda
