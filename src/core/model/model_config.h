// core/model/model_config.h: a Hugging Face config.json of a dense decoder, parsed into a plain
// struct and validated. No libtorch here.
//
// The families differ only in data (one model, core/model/decoder_model.h, reads these fields):
//   qwen2  (Qwen2, Qwen2.5, Qwen2.5-Math): q/k/v biases;
//   qwen3  (Qwen3 dense): no biases unless attention_bias, RMSNorm over each head of q and k
//          before RoPE, head_dim given (transformers' default 128, not hidden / heads);
//   llama  (Llama 3.x, and Llama 2 shapes): no biases unless attention_bias, optional llama3 RoPE
//          scaling (low/high frequency factors).
// All: SiLU, RMSNorm, rotate-half RoPE (plain or llama3), full attention (no sliding window in
// use), tied or untied LM head. rope_theta and the scaling are read from the legacy keys
// (`rope_theta`, `rope_scaling`) or from transformers 5's `rope_parameters`. Anything else is an
// Unsupported error naming the key and value, so a user knows what the checkpoint asks for.
// Adding a family: docs/architecture.md ("Model families").
// Thread-safety: plain value type.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace lorasync::model {

enum class ModelFamily { kQwen2, kQwen3, kLlama };
// "qwen2", "qwen3", "llama": the config's model_type.
const char* family_name(ModelFamily f);
// The family of a model_type or an --arch name ("qwen2", "qwen3", "llama", "llama3");
// InvalidInput naming the supported ones otherwise.
ModelFamily parse_family(const std::string& name);

// rope_type "llama3": inv_freq divided by `factor` for wavelengths above
// original_max_position_embeddings / low_freq_factor, kept below .../ high_freq_factor, and
// interpolated between (transformers' _compute_llama3_parameters).
struct RopeLlama3 {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  ModelFamily family = ModelFamily::kQwen2;
  std::int64_t vocab_size = 151936;             // rows of the embedding / LM head
  std::int64_t hidden_size = 1536;              // d
  std::int64_t intermediate_size = 8960;        // MLP width
  std::int64_t num_hidden_layers = 28;
  std::int64_t num_attention_heads = 12;        // query heads
  std::int64_t num_key_value_heads = 2;         // KV heads (GQA); head j serves queries [j*g, (j+1)*g)
  std::int64_t head_dim = 128;                  // hidden_size / num_attention_heads unless given
  std::int64_t max_position_embeddings = 4096;  // context length
  double rope_theta = 10000.0;                  // RoPE base
  double rms_norm_eps = 1e-6;                   // inside the square root
  bool tie_word_embeddings = true;              // LM head = embedding matrix
  std::string torch_dtype = "bfloat16";         // dtype of the checkpoint on disk
  std::optional<std::int64_t> bos_token_id;
  std::vector<std::int64_t> eos_token_ids;      // eos_token_id (int or list)
  bool attention_bias = true;                   // q/k/v biases (always for qwen2)
  bool qk_norm = false;                         // per-head RMSNorm of q and k before RoPE (qwen3)
  std::optional<RopeLlama3> rope_llama3;        // rope_type "llama3"; none = plain RoPE

  std::int64_t n_groups() const { return num_attention_heads / num_key_value_heads; }
  std::int64_t q_dim() const { return num_attention_heads * head_dim; }
  std::int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  // Parameters of the decoder linear layers (q,k,v,o,gate,up,down; biases excluded).
  std::int64_t n_linear_params() const;
  // All parameters (embedding counted once when tied).
  std::int64_t n_params() const;

  // Parses and validates; `label` (a path) names the source in errors.
  static ModelConfig from_json(const std::string& text, const std::string& label);
  static ModelConfig load(const std::filesystem::path& model_dir);  // <dir>/config.json
  // A complete Hugging Face config.json for this configuration.
  std::string to_json() const;
  // Presets: "tiny" (2 layers, hidden 64), "small" (~100M), "qwen2.5-1.5b-shape" (the real
  // Qwen2.5-Math-1.5B shape), "qwen3-1.7b-shape" (alias "qwen3-shape"), "llama3.2-1b-shape"
  // (alias "llama3-shape"); "qwen3-tiny", "qwen3-small", "llama3-tiny", "llama3-small" are tiny
  // and small in that family. InvalidInput
  // for an unknown name.
  static ModelConfig preset(const std::string& name);
  // This shape as another family: qwen3 drops the biases and adds the q/k norms; llama drops the
  // biases and takes Llama 3's RoPE (theta 500000, llama3 scaling). The vocabulary and token ids
  // stay (a tiny model keeps the demo's tokenizer).
  ModelConfig as_family(ModelFamily f) const;
  void validate(const std::string& label) const;
};

}  // namespace lorasync::model
