// core/model/decode_graphs.h: decode steps replayed from CUDA graphs, one graph per batch-size
// bucket.
//
// A decode step (one new token per sequence) of a given batch size runs the same kernels on the
// same shapes every time; only the data changes. On CUDA, DecodeGraphs captures the forward and
// the LM head of a step of `bucket` rows once (at::cuda::CUDAGraph, behind device_kernels.h) and
// then replays it: one graph launch instead of about fifteen kernel launches per layer, and no
// host work per kernel. For that, every tensor the step reads or writes sits at a fixed address
// per bucket:
//  - inputs: one int64 device buffer per bucket, laid out
//      tokens [Bb] | positions [Bb] | slot_mapping [Bb] | lens [Bb] | LoRA tiles | context [Lcap, Bb]
//    with the context table position-major, so that the first Lmax positions of every row are a
//    prefix of the buffer: one host-to-device copy of that prefix per step;
//  - outputs: fp32 logits [Bb, vocab], rows of one buffer shared by the buckets (allocated before
//    any capture, sized for the largest bucket);
//  - the KV pool (the caller's) and one fixed copy of each adapter slot's weights (rank R, zero
//    padded, scaling folded in), rewritten when the slot's adapter changes: the graphs outlive
//    adapter changes, which an async RL trainer makes every step.
// A batch of B rows runs in the smallest bucket >= B. Rows B..Bb are padding: token 0 at position
// 0, writing its K and V to `scratch_slot` (a slot no sequence uses) and attending to it alone.
// A bucket's graph is captured at its first step (the warm-up run before the capture computes that
// step); all graphs of one DecodeGraphs share one memory pool (they never run concurrently).
//
// Eager mode (CPU, a build without our CUDA kernels, or capture off) runs the forward directly
// on the same static buffers and padding: the tests check on CPU that it gives the plain
// forward's logits and leaves every slot but the scratch one as the plain forward does; the GPU
// check (scripts/gpu-check) compares a captured replay with eager steps and times both.
//
// Thread-safety: none; one DecodeGraphs belongs to the thread that owns its KV pool.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "core/model/kv_cache.h"
#include "core/model/lora.h"

namespace lorasync::model {

class DecoderModel;

namespace cuda {
struct Graph;
}

// One all-decode step, host side.
struct DecodeStep {
  std::vector<std::int64_t> tokens;        // [B] the new token of each row
  std::vector<std::int64_t> positions;     // [B]
  std::vector<std::int64_t> slot_mapping;  // [B] the KV slot each new token is written to
  std::vector<std::int64_t> lens;          // [B] context length of each row, its new token included
  std::vector<std::int64_t> context;       // rows' context slots in order, concatenated (sum of lens)
  std::vector<int> adapter_slot;           // [B] index into the adapters, -1 = base; empty = all base
  std::int64_t rows() const { return static_cast<std::int64_t>(tokens.size()); }
};

using AdapterSet = std::vector<std::shared_ptr<const LoraAdapter>>;  // by slot; null = empty slot

class DecodeGraphs {
 public:
  struct Options {
    std::vector<std::int64_t> buckets{1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256};
    std::int64_t max_context = 4096;  // Lcap: context slots per row in the static table
    std::int64_t scratch_slot = -1;   // a KV slot no sequence uses (required)
    bool capture = true;              // capture graphs where possible (CUDA with our kernels)
    // Adapters: each slot's adapter is copied into fixed fp32 weights of rank `lora_rank`
    // (zero-padded, its scaling folded into B, every module), which the graphs read: a new
    // adapter in a slot costs one copy, not a capture. A set with more slots or a larger rank
    // does not fit (the caller runs that step eagerly).
    int lora_slots = 0;          // the engine's --max-loras (at most 32)
    std::int64_t lora_rank = 0;  // R, the engine's --max-lora-rank (at most 64)
  };
  struct Stats {
    std::int64_t captures = 0;  // graphs captured (first step of a bucket, or after a new adapter set)
    std::int64_t replays = 0;   // steps replayed from a graph
    std::int64_t eager = 0;     // steps run eagerly on the static buffers
    double capture_seconds = 0;
  };

  // `model` and `pool` must outlive this object. Invalid options are named in the error.
  DecodeGraphs(const DecoderModel& model, KvPool& pool, Options options);
  ~DecodeGraphs();
  DecodeGraphs(const DecodeGraphs&) = delete;
  DecodeGraphs& operator=(const DecodeGraphs&) = delete;

  // The smallest bucket holding B rows; 0 when B exceeds the largest.
  std::int64_t bucket_for(std::int64_t B) const;
  // Whether a step of B rows whose longest context is max_len, with these adapters, can run here
  // (buckets, Lcap, the adapter slots and rank). Copies adapters new to their slot.
  bool fits(std::int64_t B, std::int64_t max_len, const AdapterSet& adapters);
  // Runs the step (KV written for every row) and returns fp32 logits [B, vocab]: a view of the
  // bucket's static output, valid until the next run. Throws on a step that does not fit.
  at::Tensor run(const DecodeStep& step, const AdapterSet& adapters);
  // Whether steps are replayed from captured graphs (false: eager on the static buffers).
  bool capturing() const { return capture_; }
  Stats stats() const { return stats_; }

 private:
  struct Bucket;
  Bucket& bucket(std::int64_t Bb);
  bool adapters_fit(const AdapterSet& adapters) const;
  bool set_adapters(const AdapterSet& adapters);
  void fill(Bucket& b, const DecodeStep& step, std::int64_t lmax);
  void forward_into(Bucket& b, std::int64_t lmax_eager, const DecodeStep* step);

  const DecoderModel& model_;
  KvPool& pool_;
  Options opts_;
  bool capture_ = false;
  std::vector<LoraAdapter> copies_;  // per slot: the fixed weights the graphs read
  AdapterSet adapters_;              // what each slot's copy holds (null: empty), kept alive
  std::map<std::int64_t, std::unique_ptr<Bucket>> buckets_;
  std::shared_ptr<cuda::Graph> first_graph_;  // the pool every later capture shares
  at::Tensor logits_;  // fp32 [largest bucket, vocab]: every bucket's output rows
  Stats stats_;
};

// The tiles table of a graph bucket: lora_tiles of the rows of each part, padded with empty tiles
// (count 0) to `max_tiles` rows of 2 + tile_rows ints. Throws when the rows need more tiles.
std::vector<int> padded_lora_tiles(const std::vector<std::vector<std::int64_t>>& rows_of_part, int tile_rows,
                                   std::int64_t max_tiles);

}  // namespace lorasync::model
