// core/model/device_kernels_stub.cpp: builds without our CUDA kernels (every preset but `cuda`).
// libtorch still runs the model on CUDA through the references; only our kernels are absent.
#include "core/model/device_kernels.h"
#include "util/error.h"

namespace lorasync::model {

bool have_cuda_kernels() { return false; }

namespace cuda {
at::Tensor rms_norm(const at::Tensor&, const at::Tensor&, double) {
  throw_unsupported("cuda::rms_norm: this build has no CUDA kernels (configure the cuda preset)");
}
bool paged_decode_attention_fits(const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor paged_decode_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&) {
  throw_unsupported("cuda::paged_decode_attention: this build has no CUDA kernels (configure the cuda preset)");
}
bool lora_tiles_fit(const at::Tensor&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&) {
  return false;
}
void lora_apply_tiles(const at::Tensor&, at::Tensor&, const at::Tensor&, const std::vector<at::Tensor>&,
                      const std::vector<at::Tensor>&, const std::vector<double>&) {
  throw_unsupported("cuda::lora_apply_tiles: this build has no CUDA kernels (configure the cuda preset)");
}
struct Graph {};
bool graphs_available() { return false; }
std::shared_ptr<Graph> capture_graph(const std::function<void()>&, c10::Device, const Graph*) {
  throw_unsupported("cuda::capture_graph: this build has no CUDA kernels (configure the cuda preset)");
}
void replay_graph(Graph&) {
  throw_unsupported("cuda::replay_graph: this build has no CUDA kernels (configure the cuda preset)");
}
}  // namespace cuda

}  // namespace lorasync::model
