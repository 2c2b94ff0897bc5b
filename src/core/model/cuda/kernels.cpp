// core/model/cuda/kernels.cpp: the glue between at::Tensor and our raw CUDA launchers (launch.h):
// checks devices, dtypes and layouts, allocates outputs through libtorch's caching allocator and
// launches on the current stream. Compiled only in the `cuda` preset.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/model/cuda/launch.h"
#include "core/model/device_kernels.h"
#include "util/error.h"

namespace lorasync::model {

bool have_cuda_kernels() { return true; }

namespace cuda {

namespace {

ElemType elem_type(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return ElemType::kF32;
    case at::kBFloat16: return ElemType::kBF16;
    case at::kHalf: return ElemType::kF16;
    default:
      throw_unsupported("cuda::{}: dtype {} (float32, bfloat16 or float16 only)", what,
                        std::string(c10::toString(t.scalar_type())));
  }
}

void check_launch(int err, const char* what) {
  if (err != 0) throw_env("cuda::{}: kernel launch failed (cudaError {})", what, err);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!x.is_cuda() || weight.device() != x.device())
    throw_unsupported("cuda::rms_norm: x and weight must be on one CUDA device");
  if (weight.scalar_type() != x.scalar_type())
    throw_unsupported("cuda::rms_norm: weight dtype {} differs from x dtype {}",
                      std::string(c10::toString(weight.scalar_type())),
                      std::string(c10::toString(x.scalar_type())));
  const auto d = x.size(-1);
  if (weight.dim() != 1 || weight.size(0) != d)
    throw_unsupported("cuda::rms_norm: weight must be [{}]", d);
  const auto type = elem_type(x, "rms_norm");
  c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto y = at::empty_like(xc);
  const auto rows = d == 0 ? 0 : xc.numel() / d;
  check_launch(launch_rms_norm(xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rows, d,
                               static_cast<float>(eps), type,
                               c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "rms_norm");
  return y;
}

}  // namespace cuda
}  // namespace lorasync::model
