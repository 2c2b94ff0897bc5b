// core/model/device_kernels.h: our own device kernels behind the model's functions.
//
// One interface, two implementations: model::rms_norm, the decode attention and LoRA dispatch on the tensor's
// device. A CUDA tensor runs our kernel when the build has them (the `cuda` preset compiles
// core/model/cuda/*.cu) and no gradient is needed through the call; everything else runs the
// reference, the plain libtorch expression of the same maths, which the tests compare against.
// No CUDA header here. Thread-safety: all functions are reentrant.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace lorasync::model {

// True when this binary was built with our CUDA kernels (the `cuda` preset).
bool have_cuda_kernels();

// The libtorch reference of RMSNorm (Hugging Face's numerics); model::rms_norm dispatches.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

namespace cuda {
// Fused RMSNorm on the current CUDA stream: x [..., d] and weight [d] of one dtype (fp32, bf16,
// fp16) on one CUDA device. Unsupported (named) without the kernels or for other inputs.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Decode attention reading the paged KV pool in place (one query token per sequence):
// q [B, nh, hd]; k_pool, v_pool [n_slots, nkv, hd], one dtype (fp32, bf16, fp16) on one CUDA
// device; sequence b attends to slots[b][0 .. lens[b]) (int64 [B, Lmax] and [B] on that device).
// Returns [B, nh * hd]; softmax(q k^T / sqrt(hd)) v in fp32, rounded once. A sequence with no keys
// reads zeros. Unsupported (named) without the kernels or where paged_decode_attention_fits is false.
bool paged_decode_attention_fits(const at::Tensor& q, const at::Tensor& k_pool);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const at::Tensor& lens);

// The batched LoRA kernel's limits (cuda/launch.h's, repeated here without the CUDA folder).
inline constexpr int kLoraKernelTileRows = 16;
inline constexpr int kLoraKernelMaxRank = 64;
inline constexpr int kLoraKernelMaxAdapters = 32;

// y[row] += scales[a] * B[a] (A[a] x[row]) for the adapter a of each row of x [T, in], in place on
// y [T, out] (contiguous), one launch: tiles is lora_tiles' table (int32 on the device), A[a]
// [r, in] and B[a] [out, r] (undefined: adapter a does not target this projection). x and y share
// a dtype; every defined A and B share another; all on x's CUDA device. Unsupported (named)
// without the kernels or where lora_tiles_fit is false.
bool lora_tiles_fit(const at::Tensor& x, const std::vector<at::Tensor>& A, const std::vector<at::Tensor>& B);
void lora_apply_tiles(const at::Tensor& x, at::Tensor& y, const at::Tensor& tiles, const std::vector<at::Tensor>& A,
                      const std::vector<at::Tensor>& B, const std::vector<double>& scales);

// CUDA graphs (at::cuda::CUDAGraph). capture_graph runs `body` once on a side stream of `device`
// (the warm-up: it really computes, and creates cuBLAS handles and workspaces outside the
// capture), then captures a second call into a graph, in thread-local capture mode so that other
// threads' CUDA calls are not disturbed. The graph's memory comes from the pool of `share_pool`
// (null: a new pool); tensors the body allocates must not be used after it returns. The current
// stream waits for the side stream's work. replay_graph launches the graph on the current stream.
// Unsupported (named) in a build without our CUDA kernels; capture errors are thrown with CUDA's
// message (the caller falls back to eager steps).
struct Graph;
bool graphs_available();
std::shared_ptr<Graph> capture_graph(const std::function<void()>& body, c10::Device device, const Graph* share_pool);
void replay_graph(Graph& graph);
}  // namespace cuda

}  // namespace lorasync::model
