// core/model/cuda/elem.cuh: conversions between our kernels' element types (fp32, bf16, fp16) and
// the fp32 they compute in. Device code only; included by the .cu files of this folder.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lorasync::model::cuda {

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half(v); }

}  // namespace lorasync::model::cuda
