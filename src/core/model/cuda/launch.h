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

}  // namespace lorasync::model::cuda
