#include "core/model/qwen2_config.h"

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/files.h"

namespace lorasync::model {

using nlohmann::json;

std::int64_t Qwen2Config::n_linear_params() const {
  const std::int64_t d = hidden_size;
  const std::int64_t attn = d * q_dim() + 2 * d * kv_dim() + q_dim() * d;
  const std::int64_t mlp = 3 * d * intermediate_size;
  return num_hidden_layers * (attn + mlp);
}

std::int64_t Qwen2Config::n_params() const {
  const std::int64_t d = hidden_size;
  const std::int64_t per_layer_extra = q_dim() + 2 * kv_dim() + 2 * d;  // biases + 2 norms
  std::int64_t n = n_linear_params() + num_hidden_layers * per_layer_extra + vocab_size * d + d;
  if (!tie_word_embeddings) n += vocab_size * d;
  return n;
}

namespace {

std::int64_t get_int(const json& j, const char* key, const std::string& label, std::int64_t def,
                     bool required) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) throw_invalid("{}: required key '{}' is missing", label, key);
    return def;
  }
  if (!it->is_number_integer())
    throw_invalid("{}: '{}' must be an integer, got {}", label, key, it->dump());
  return it->get<std::int64_t>();
}

double get_num(const json& j, const char* key, const std::string& label, double def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number()) throw_invalid("{}: '{}' must be a number, got {}", label, key, it->dump());
  return it->get<double>();
}

}  // namespace

Qwen2Config Qwen2Config::from_json(const std::string& text, const std::string& label) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw_invalid("{}: not valid JSON: {}", label, e.what());
  }
  if (!j.is_object()) throw_invalid("{}: config must be a JSON object", label);

  std::string model_type = j.value("model_type", "");
  bool arch_ok = false;
  if (j.contains("architectures") && j["architectures"].is_array())
    for (const auto& a : j["architectures"])
      if (a.is_string() && a.get<std::string>() == "Qwen2ForCausalLM") arch_ok = true;
  if (model_type != "qwen2" && !arch_ok)
    throw_unsupported(
        "{}: model_type '{}' is not supported (lorasync serves the Qwen2 family: model_type "
        "\"qwen2\", architectures [\"Qwen2ForCausalLM\"])",
        label, model_type);

  Qwen2Config c;
  c.vocab_size = get_int(j, "vocab_size", label, 0, true);
  c.hidden_size = get_int(j, "hidden_size", label, 0, true);
  c.intermediate_size = get_int(j, "intermediate_size", label, 0, true);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", label, 0, true);
  c.num_attention_heads = get_int(j, "num_attention_heads", label, 0, true);
  c.num_key_value_heads =
      get_int(j, "num_key_value_heads", label, c.num_attention_heads, false);
  c.head_dim = get_int(j, "head_dim", label,
                       c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0, false);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", label, 32768, false);
  c.rope_theta = get_num(j, "rope_theta", label, 10000.0);
  c.rms_norm_eps = get_num(j, "rms_norm_eps", label, 1e-6);
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean())
      throw_invalid("{}: 'tie_word_embeddings' must be a boolean", label);
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  } else {
    c.tie_word_embeddings = false;  // transformers Qwen2Config default
  }
  c.torch_dtype = j.value("torch_dtype", std::string("float32"));
  if (j.contains("bos_token_id") && j["bos_token_id"].is_number_integer())
    c.bos_token_id = j["bos_token_id"].get<std::int64_t>();
  if (j.contains("eos_token_id")) {
    const auto& e = j["eos_token_id"];
    if (e.is_number_integer()) c.eos_token_ids.push_back(e.get<std::int64_t>());
    else if (e.is_array())
      for (const auto& x : e)
        if (x.is_number_integer()) c.eos_token_ids.push_back(x.get<std::int64_t>());
  }

  // What we cannot run, named.
  std::string act = j.value("hidden_act", std::string("silu"));
  if (act != "silu")
    throw_unsupported("{}: hidden_act '{}' is not supported (only \"silu\")", label, act);
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    throw_unsupported("{}: rope_scaling {} is not supported (only plain RoPE)", label,
                      j["rope_scaling"].dump());
  if (j.value("use_sliding_window", false)) {
    std::int64_t window = get_int(j, "sliding_window", label, 0, false);
    std::int64_t max_window_layers = get_int(j, "max_window_layers", label, 0, false);
    if (window < c.max_position_embeddings && max_window_layers < c.num_hidden_layers)
      throw_unsupported(
          "{}: use_sliding_window with sliding_window {} < max_position_embeddings {} is not "
          "supported",
          label, window, c.max_position_embeddings);
  }
  if (get_num(j, "attention_dropout", label, 0.0) != 0.0)
    throw_unsupported("{}: attention_dropout must be 0 for inference and RL", label);
  c.validate(label);
  return c;
}

void Qwen2Config::validate(const std::string& label) const {
  auto positive = [&](const char* k, std::int64_t v) {
    if (v <= 0) throw_invalid("{}: '{}' must be positive, got {}", label, k, v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  positive("max_position_embeddings", max_position_embeddings);
  if (num_attention_heads % num_key_value_heads != 0)
    throw_invalid("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", label,
                  num_attention_heads, num_key_value_heads);
  if (head_dim % 2 != 0) throw_invalid("{}: head_dim {} must be even for RoPE", label, head_dim);
  if (!(rope_theta > 0)) throw_invalid("{}: rope_theta must be positive, got {}", label, rope_theta);
  if (!(rms_norm_eps > 0))
    throw_invalid("{}: rms_norm_eps must be positive, got {}", label, rms_norm_eps);
}

Qwen2Config Qwen2Config::load(const std::filesystem::path& model_dir) {
  auto path = model_dir / "config.json";
  return from_json(read_file(path), path.string());
}

std::string Qwen2Config::to_json() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["model_type"] = "qwen2";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  if (head_dim != hidden_size / num_attention_heads) j["head_dim"] = head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["max_window_layers"] = num_hidden_layers;
  j["rope_theta"] = rope_theta;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_scaling"] = nullptr;
  j["hidden_act"] = "silu";
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = 0.02;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["torch_dtype"] = torch_dtype;
  j["use_cache"] = true;
  j["use_sliding_window"] = false;
  j["sliding_window"] = max_position_embeddings;
  if (bos_token_id) j["bos_token_id"] = *bos_token_id;
  if (eos_token_ids.size() == 1) j["eos_token_id"] = eos_token_ids[0];
  else if (!eos_token_ids.empty()) j["eos_token_id"] = eos_token_ids;
  j["transformers_version"] = "4.45.0";
  return j.dump(2) + "\n";
}

Qwen2Config Qwen2Config::preset(const std::string& name) {
  Qwen2Config c;
  c.bos_token_id = 151643;
  c.eos_token_ids = {151643};
  if (name == "tiny") {
    c.hidden_size = 64;
    c.intermediate_size = 176;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.max_position_embeddings = 4096;
    c.rope_theta = 10000.0;
    c.torch_dtype = "float32";
  } else if (name == "small") {
    c.hidden_size = 512;
    c.intermediate_size = 1536;
    c.num_hidden_layers = 12;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 2;
    c.head_dim = 64;
    c.max_position_embeddings = 4096;
    c.torch_dtype = "float32";
  } else if (name == "qwen2.5-1.5b-shape") {
    // Qwen2.5-Math-1.5B: 28 layers, hidden 1536, MLP 8960, 12/2 heads of 128, tied, theta 10000.
    c.hidden_size = 1536;
    c.intermediate_size = 8960;
    c.num_hidden_layers = 28;
    c.num_attention_heads = 12;
    c.num_key_value_heads = 2;
    c.head_dim = 128;
    c.max_position_embeddings = 4096;
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-6;
    c.torch_dtype = "bfloat16";
  } else {
    throw_invalid("unknown model preset '{}' (known: tiny, small, qwen2.5-1.5b-shape)", name);
  }
  return c;
}

}  // namespace lorasync::model
