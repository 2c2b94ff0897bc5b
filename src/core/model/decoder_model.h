// core/model/decoder_model.h: the dense decoder of every supported family (Qwen2, Qwen3, Llama 3;
// the differences are ModelConfig data) in libtorch, numerically equal to Hugging Face
// transformers' Qwen2ForCausalLM, Qwen3ForCausalLM and LlamaForCausalLM in fp32.
//
// Semantics (checked by tests against an independent implementation and against transformers):
//  - RMSNorm in fp32: x * rsqrt(mean(x^2) + eps), cast back to the input dtype, then * weight;
//  - RoPE rotate-half (not interleaved): inv_freq = 1 / theta^(2i/d) in fp32 (llama3-scaled when
//    the config says so), angle = pos * inv_freq, q' = q cos + rotate_half(q) sin, cos/sin over
//    cat(angle, angle);
//  - grouped-query attention with q/k/v bias where the config has one (qwen2), q and k each
//    RMSNormed per head before RoPE where it has the norms (qwen3), scale 1/sqrt(head_dim),
//    softmax in fp32, KV head j serving query heads [j*g, (j+1)*g);
//  - SwiGLU MLP down(silu(gate(x)) * up(x)); LM head tied to the embedding or separate.
//
// Batches are flat: tokens [T] with positions [T] and segments (one per sequence) that never
// attend to each other. The same forward serves
//  - training on packed rows (no KV cache; positions restart per segment),
//  - batched prefill of variable-length prompts and incremental decode (KvPool + AttnMeta),
//  - several LoRA adapters in one batch (LoraBatch).
// Linear layers, norms and the MLP run on the whole [T, d] batch; attention runs per segment, or
// as one padded batched call for pure decode steps.
//
// Weights live in the model dtype (fp32/bf16/fp16) on one device; logits are returned in fp32.
// Thread-safety: forward() is const and may run concurrently on different inputs; merge_lora()
// mutates weights and needs exclusive access.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/model/kv_cache.h"
#include "core/model/lora.h"
#include "core/model/model_config.h"

namespace lorasync::model {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Flat batch of new tokens.
struct Batch {
  at::Tensor tokens;           // int64 [T]
  at::Tensor positions;        // int64 [T]
  std::vector<Segment> segs;   // cover [0, T) in order
  std::int64_t n_tokens() const { return tokens.defined() ? tokens.size(0) : 0; }
};

// Builds a batch from sequences of new token ids; pasts[i] = tokens of sequence i already cached
// (positions start there). Empty pasts = all zero.
Batch make_batch(const std::vector<std::vector<std::int64_t>>& seqs,
                 const std::vector<std::int64_t>& pasts, c10::Device device);

class DecoderModel {
 public:
  struct Layer {
    at::Tensor input_norm;                 // [d]
    at::Tensor q_w, q_b, k_w, k_b, v_w, v_b, o_w;  // [q_dim,d] [q_dim] [kv,d] [kv] [kv,d] [kv] [d,q_dim]
                                                   // (biases undefined without attention_bias)
    at::Tensor q_norm, k_norm;             // [head_dim] each, with qk_norm (else undefined)
    at::Tensor post_norm;                  // [d]
    at::Tensor gate_w, up_w, down_w;       // [I,d] [I,d] [d,I]
  };

  // Loads a Hugging Face directory (config.json + safetensors, sharded or not), converting weights
  // to `dtype` on `device`. Errors name the directory, the tensor and the shapes.
  static std::unique_ptr<DecoderModel> load(const std::filesystem::path& dir, c10::ScalarType dtype,
                                          c10::Device device);
  // From named tensors with Hugging Face names (any dtype/device; converted).
  static std::unique_ptr<DecoderModel> from_named(const ModelConfig& cfg, const NamedTensors& named,
                                                c10::ScalarType dtype, c10::Device device,
                                                const std::string& label = "weights");

  const ModelConfig& config() const { return cfg_; }
  c10::ScalarType dtype() const { return dtype_; }
  c10::Device device() const { return device_; }

  // Final-normed hidden states [T, d] of every new token.
  // kv/meta: both null (no cache: each segment attends to its own new tokens only) or both set.
  // checkpoint_layers (no cache only): each decoder layer keeps only its input for the backward
  // pass and recomputes its activations there (autograd_ops.h checkpoint); same values and
  // gradients, one extra forward, memory of one layer's activations instead of all of them.
  at::Tensor forward(const Batch& batch, const LoraBatch* lora = nullptr, KvPool* kv = nullptr,
                     const AttnMeta* meta = nullptr, bool checkpoint_layers = false) const;
  // LM head: hidden [N, d] -> fp32 logits [N, vocab].
  at::Tensor logits(const at::Tensor& hidden) const;
  // The LM head weight [vocab, d] (the embedding when tied).
  const at::Tensor& lm_head_weight() const { return cfg_.tie_word_embeddings ? embed_ : lm_head_; }

  // W += sign * s * B A for every targeted module (sign +1 merge, -1 unmerge). For checks.
  void merge_lora(const LoraAdapter& adapter, double sign = 1.0);

  // Weights with Hugging Face names (lm_head.weight only when untied).
  NamedTensors named_weights() const;
  const Layer& layer(std::int64_t i) const { return layers_.at(static_cast<std::size_t>(i)); }

 private:
  DecoderModel(ModelConfig cfg, c10::ScalarType dtype, c10::Device device);
  at::Tensor attention(std::int64_t l, const at::Tensor& x, const Batch& batch,
                       const at::Tensor& cos, const at::Tensor& sin, const LoraBatch* lora,
                       KvPool* kv, const AttnMeta* meta) const;
  // One decoder layer: h + attention, then + MLP.
  at::Tensor decoder_layer(std::int64_t l, const at::Tensor& h, const Batch& batch, const at::Tensor& cos,
                           const at::Tensor& sin, const LoraBatch* lora, KvPool* kv, const AttnMeta* meta) const;
  at::Tensor& module_weight(std::int64_t layer, LoraModule m);
  // Small steps on our CPU kernels (cpu_decode.cpp; set_cpu_fast_paths).
  bool cpu_decode_applies(const Batch& batch, const KvPool* kv, const AttnMeta* meta) const;
  at::Tensor forward_cpu_decode(const Batch& batch, const LoraBatch* lora, KvPool& kv,
                                const AttnMeta& meta) const;

  ModelConfig cfg_;
  c10::ScalarType dtype_;
  c10::Device device_;
  at::Tensor embed_;     // [vocab, d]
  at::Tensor lm_head_;   // [vocab, d] when untied
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  at::Tensor inv_freq_;  // fp32 [head_dim / 2]
};

// On CPU, fp32 steps of up to 4,096 tokens with a KV cache and no gradient (decode rows, and the
// prefill chunks of a mixed step, with our causal attention kernel) and the LM head of up
// to 256 rows run our kernels (cpu_kernels.h): the libtorch expression of the same maths
// pays a dispatcher round trip per small op and streams the weights at a third of the memory
// bandwidth. Off = the libtorch path everywhere (tests compare the two; bench forward's baseline).
// Returns the previous setting. Process-wide.
bool set_cpu_fast_paths(bool on);
bool cpu_fast_paths();

// An uninitialised CPU tensor whose memory is advised into transparent huge pages (2 MiB) where
// it is at least that large: the weights, streamed once per decode step, then cost one TLB entry
// per 2 MiB instead of per 4 KiB (about 1.3x the streaming rate on the development machine).
// Plain at::empty elsewhere or when the kernel refuses.
at::Tensor empty_cpu_huge_pages(at::IntArrayRef shape, c10::ScalarType dtype);

// RMSNorm as Hugging Face computes it: our fused kernel on CUDA where the build has it and no
// gradient is needed (device_kernels.h), else rms_norm_reference.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// cos, sin [T, head_dim] (fp32) for positions [T].
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& positions, const at::Tensor& inv_freq);
at::Tensor rope_inv_freq(std::int64_t head_dim, double theta, c10::Device device);
// The config's inv_freq: plain, or llama3-scaled (fp32, as transformers computes it).
at::Tensor rope_inv_freq(const ModelConfig& cfg, c10::Device device);
// x [T, heads, head_dim]: x cos + rotate_half(x) sin (cos/sin cast to x's dtype).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// Causal attention of one segment: q [L, nh, hd], k/v [S, nkv, hd], query i sees keys j <= past+i
// with S = past + L. Returns [L, nh * hd]. Runs libtorch's fused scaled_dot_product_attention;
// segment_attention_reference is the explicit softmax(QK^T/sqrt(hd))V the tests compare with.
at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             std::int64_t past);
at::Tensor segment_attention_reference(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, std::int64_t past);
// Causal attention of a packed row without a cache: q [T, nh, hd], k/v [T, nkv, hd], each segment
// attending to itself only. On CUDA in bf16/fp16 (head_dim a multiple of 8, at most 256) one
// varlen flash-attention call with cumulative sequence lengths; elsewhere segment_attention per
// segment. Both keep a logsumexp per query for the backward pass, never the scores.
// set_varlen_attention(false) forces the per-segment path (tests compare the two); process-wide,
// returns the previous setting.
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<Segment>& segs);
bool set_varlen_attention(bool on);
// Decode attention (one query token per sequence) over the paged KV pool: q [B, nh, hd], k/v pools
// [n_slots, nkv, hd]; sequence b attends to slots[b][0 .. lens[b]) of slots int64 [B, Lmax], whose
// padding bias [B, Lmax] is 0 for those and -inf past them. Returns [B, nh * hd]. On CUDA our
// kernel reads the pool in place where the build has it and the shapes fit (lens defined); the
// reference gathers each sequence's keys and values into a padded block and runs two matmuls.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const at::Tensor& bias, const at::Tensor& lens);
at::Tensor paged_decode_attention_reference(const at::Tensor& q, const at::Tensor& k_pool,
                                            const at::Tensor& v_pool, const at::Tensor& slots,
                                            const at::Tensor& bias);

// Random weights with Hugging Face names, N(0, std) for matrices, biases and norm weights
// perturbed around their defaults, generated on CPU from `seed` and stored in `dtype`.
NamedTensors random_weights(const ModelConfig& cfg, std::uint64_t seed, c10::ScalarType dtype,
                            double std = 0.02);

}  // namespace lorasync::model
