// core/model/device_kernels.h: our own device kernels behind the model's functions.
//
// One interface, two implementations: model::rms_norm (and later kernels) dispatch on the tensor's
// device. A CUDA tensor runs our kernel when the build has them (the `cuda` preset compiles
// core/model/cuda/*.cu) and no gradient is needed through the call; everything else runs the
// reference, the plain libtorch expression of the same maths, which the tests compare against.
// No CUDA header here. Thread-safety: all functions are reentrant.
#pragma once

#include <ATen/core/Tensor.h>

namespace lorasync::model {

// True when this binary was built with our CUDA kernels (the `cuda` preset).
bool have_cuda_kernels();

// The libtorch reference of RMSNorm (Hugging Face's numerics); model::rms_norm dispatches.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

namespace cuda {
// Fused RMSNorm on the current CUDA stream: x [..., d] and weight [d] of one dtype (fp32, bf16,
// fp16) on one CUDA device. Unsupported (named) without the kernels or for other inputs.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
}  // namespace cuda

}  // namespace lorasync::model
