// core/model/runtime.h: device, dtype and thread settings for libtorch, chosen at run time.
//
// The same code and the same libtorch (2.x, CUDA-enabled) run on CPU and on CUDA: nothing here or in
// the model hard-codes a device or a dtype. On CPU, fp32 is the compute dtype that performs
// (bf16 GEMM is ~20x slower on the development machines); `auto` picks it there.
// Thread-safety: set_compute_threads must be called at start-up, before parallel work.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace lorasync::model {

// "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", or "auto" (= fp32 on CPU, bf16 on CUDA).
// InvalidInput naming `what` for anything else.
c10::ScalarType parse_dtype(const std::string& name, c10::Device device, const std::string& what);
// "cpu", "cuda", "cuda:N". Unsupported (with the reason) when CUDA is asked for and absent.
c10::Device parse_device(const std::string& name);
std::string dtype_name(c10::ScalarType t);  // "float32", "bfloat16", "float16"

// Intra-op threads for libtorch (libtorch starts with 1 here); 0 = all hardware threads.
void set_compute_threads(int n);
int compute_threads();

}  // namespace lorasync::model
