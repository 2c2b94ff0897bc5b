#include "core/model/runtime.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <thread>

#include "util/error.h"

namespace lorasync::model {

c10::ScalarType parse_dtype(const std::string& name, c10::Device device, const std::string& what) {
  if (name == "auto") return device.is_cpu() ? c10::kFloat : c10::kBFloat16;
  if (name == "float32" || name == "fp32" || name == "float") return c10::kFloat;
  if (name == "bfloat16" || name == "bf16") return c10::kBFloat16;
  if (name == "float16" || name == "fp16" || name == "half") return c10::kHalf;
  throw_invalid("{}: dtype must be one of auto, float32, bfloat16, float16; got '{}'", what, name);
}

c10::Device parse_device(const std::string& name) {
  c10::Device d(c10::kCPU);
  try {
    d = c10::Device(name);
  } catch (const std::exception&) {
    throw_invalid("device must be cpu, cuda or cuda:N; got '{}'", name);
  }
  if (d.is_cuda() && !at::hasCUDA())
    throw_unsupported("device '{}' requested but this build of libtorch has no CUDA device available",
                      name);
  if (!d.is_cpu() && !d.is_cuda()) throw_unsupported("device '{}' is not supported (cpu or cuda)", name);
  return d;
}

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kBFloat16: return "bfloat16";
    case c10::kHalf: return "float16";
    case c10::kDouble: return "float64";
    default: return std::string(c10::toString(t));
  }
}

void set_compute_threads(int n) {
  if (n <= 0) n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(n);
}

int compute_threads() { return at::get_num_threads(); }

}  // namespace lorasync::model
