// core/model/qwen2_config.h: the Hugging Face config.json of the Qwen2 family (Qwen2, Qwen2.5,
// Qwen2.5-Math), parsed into a plain struct and validated. No libtorch here.
//
// Supported: model_type "qwen2" / architectures ["Qwen2ForCausalLM"], SiLU, RoPE without
// scaling, full attention (no sliding window in use), tied or untied LM head. Anything else is an
// Unsupported error naming the key and value, so a user knows what the checkpoint asks for.
// Thread-safety: plain value type.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace lorasync::model {

struct Qwen2Config {
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

  std::int64_t n_groups() const { return num_attention_heads / num_key_value_heads; }
  std::int64_t q_dim() const { return num_attention_heads * head_dim; }
  std::int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  // Parameters of the decoder linear layers (q,k,v,o,gate,up,down; biases excluded).
  std::int64_t n_linear_params() const;
  // All parameters (embedding counted once when tied).
  std::int64_t n_params() const;

  // Parses and validates; `label` (a path) names the source in errors.
  static Qwen2Config from_json(const std::string& text, const std::string& label);
  static Qwen2Config load(const std::filesystem::path& model_dir);  // <dir>/config.json
  // A complete Hugging Face config.json for this configuration.
  std::string to_json() const;
  // Presets: "tiny" (2 layers, hidden 64), "small" (~100M), "qwen2.5-1.5b-shape" (the real
  // Qwen2.5-Math-1.5B shape). InvalidInput for an unknown name.
  static Qwen2Config preset(const std::string& name);
  void validate(const std::string& label) const;
};

}  // namespace lorasync::model
