// core/model/kv_cache.h: KV storage the model writes to and reads from, decoupled from how
// slots are allocated.
//
// A KvPool holds, per layer, K and V for n_slots token positions: [n_slots, n_kv_heads, head_dim]
// (keys after RoPE, like Hugging Face's cache). The caller of a forward says, in AttnMeta, which
// slot each new token goes to and which slots make up each sequence's context. The paged engine
// maps slots to 16-token blocks; ContiguousKvCache (tests, tools) gives each sequence a range.
//
// Thread-safety: none; a pool belongs to one forward at a time (the engine thread).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "core/model/model_config.h"

namespace lorasync::model {

struct KvPool {
  std::vector<at::Tensor> k, v;  // per layer: [n_slots, n_kv_heads, head_dim]
  static KvPool allocate(const ModelConfig& cfg, std::int64_t n_slots, c10::ScalarType dtype,
                         c10::Device device);
  std::int64_t n_slots() const { return k.empty() ? 0 : k[0].size(0); }
  // Bytes per token position over all layers (K and V).
  static std::int64_t bytes_per_slot(const ModelConfig& cfg, c10::ScalarType dtype);
};

// One contiguous run of new tokens of one sequence in a flat batch.
struct Segment {
  std::int64_t begin = 0;  // first row in the flat batch
  std::int64_t len = 0;    // new tokens
  std::int64_t past = 0;   // tokens of this sequence already in the KV cache (first position)
};

// Slot bookkeeping for one forward with a KV cache.
struct AttnMeta {
  at::Tensor slot_mapping;                // int64 [T]: slot of each new token
  std::vector<at::Tensor> context_slots;  // per segment: int64 [past + len], positions in order
  // Optional batched decode, when every segment has len 1 (B = number of segments):
  at::Tensor decode_slots;  // int64 [B, Lmax], padded with slot 0
  at::Tensor decode_bias;   // float [B, Lmax]: 0 for real keys, -inf for padding
  at::Tensor decode_lens;   // int64 [B]: real keys of each row (the device kernel reads these)
};

// A simple cache for a fixed set of sequences, each owning `capacity` consecutive slots.
class ContiguousKvCache {
 public:
  ContiguousKvCache(const ModelConfig& cfg, std::int64_t n_seqs, std::int64_t capacity,
                    c10::ScalarType dtype, c10::Device device);
  KvPool& pool() { return pool_; }
  std::int64_t length(std::int64_t seq) const { return lengths_.at(static_cast<std::size_t>(seq)); }
  // Metadata for a forward whose segment i holds new tokens of sequence seq_ids[i]; segment
  // `past` values must equal the current lengths. Advances the lengths. `batched_decode` builds
  // the padded decode tensors when every segment has one token.
  AttnMeta plan(const std::vector<Segment>& segs, const std::vector<std::int64_t>& seq_ids,
                bool batched_decode = true);
  void reset(std::int64_t seq) { lengths_.at(static_cast<std::size_t>(seq)) = 0; }

 private:
  KvPool pool_;
  std::int64_t capacity_;
  std::vector<std::int64_t> lengths_;
  c10::Device device_;
};

}  // namespace lorasync::model
