// core/model/cuda/graphs.cpp: CUDA graph capture and replay (device_kernels.h) over
// at::cuda::CUDAGraph. Compiled only in the `cuda` preset.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>

#include "core/model/device_kernels.h"
#include "util/error.h"

namespace lorasync::model::cuda {

struct Graph {
  at::cuda::CUDAGraph graph;
};

bool graphs_available() { return true; }

std::shared_ptr<Graph> capture_graph(const std::function<void()>& body, c10::Device device, const Graph* share_pool) {
  if (!device.is_cuda()) throw_unsupported("cuda::capture_graph: device {} is not a CUDA device", device.str());
  c10::cuda::CUDAGuard guard(device);
  const auto index = device.index();
  auto current = c10::cuda::getCurrentCUDAStream(index);
  // Capture cannot run on the default stream: a side stream that first waits for the current one.
  auto side = c10::cuda::getStreamFromPool(false, index);
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);
  auto g = std::make_shared<Graph>();
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    body();  // warm-up: computes this step for real
    if (share_pool != nullptr)
      g->graph.capture_begin(const_cast<Graph*>(share_pool)->graph.pool(), cudaStreamCaptureModeThreadLocal);
    else
      g->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      body();
    } catch (...) {
      try {
        g->graph.capture_end();  // ends the capture so that the stream is usable again
      } catch (...) {
      }
      throw;
    }
    g->graph.capture_end();
  }
  at::cuda::CUDAEvent done;
  done.record(side);
  done.block(current);
  return g;
}

void replay_graph(Graph& graph) { graph.graph.replay(); }

}  // namespace lorasync::model::cuda
