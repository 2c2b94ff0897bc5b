#include "core/model/model_config.h"

#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/files.h"

namespace lorasync::model {

using nlohmann::json;

std::int64_t ModelConfig::n_linear_params() const {
  const std::int64_t d = hidden_size;
  const std::int64_t attn = d * q_dim() + 2 * d * kv_dim() + q_dim() * d;
  const std::int64_t mlp = 3 * d * intermediate_size;
  return num_hidden_layers * (attn + mlp);
}

std::int64_t ModelConfig::n_params() const {
  const std::int64_t d = hidden_size;
  std::int64_t per_layer_extra = 2 * d;  // 2 norms
  if (attention_bias) per_layer_extra += q_dim() + 2 * kv_dim();
  if (qk_norm) per_layer_extra += 2 * head_dim;
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

bool get_bool(const json& j, const char* key, const std::string& label, bool def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_boolean()) throw_invalid("{}: '{}' must be a boolean, got {}", label, key, it->dump());
  return it->get<bool>();
}

// rope_type of a rope_scaling / rope_parameters object ("type" in older configs); "default" when
// it names none.
std::string rope_type_of(const json& r) {
  if (r.contains("rope_type") && r["rope_type"].is_string()) return r["rope_type"].get<std::string>();
  if (r.contains("type") && r["type"].is_string()) return r["type"].get<std::string>();
  return "default";
}

}  // namespace

const char* family_name(ModelFamily f) {
  switch (f) {
    case ModelFamily::kQwen2: return "qwen2";
    case ModelFamily::kQwen3: return "qwen3";
    case ModelFamily::kLlama: return "llama";
  }
  return "?";
}

ModelFamily parse_family(const std::string& name) {
  if (name == "qwen2") return ModelFamily::kQwen2;
  if (name == "qwen3") return ModelFamily::kQwen3;
  if (name == "llama" || name == "llama3") return ModelFamily::kLlama;
  throw_invalid("model family '{}' is not supported (supported: qwen2, qwen3, llama)", name);
}

ModelConfig ModelConfig::from_json(const std::string& text, const std::string& label) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw_invalid("{}: not valid JSON: {}", label, e.what());
  }
  if (!j.is_object()) throw_invalid("{}: config must be a JSON object", label);

  std::string model_type = j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "";
  if (model_type.empty() && j.contains("architectures") && j["architectures"].is_array())
    for (const auto& a : j["architectures"]) {
      if (!a.is_string()) continue;
      const auto arch = a.get<std::string>();
      if (arch == "Qwen2ForCausalLM") model_type = "qwen2";
      else if (arch == "Qwen3ForCausalLM") model_type = "qwen3";
      else if (arch == "LlamaForCausalLM") model_type = "llama";
    }
  if (model_type != "qwen2" && model_type != "qwen3" && model_type != "llama")
    throw_unsupported(
        "{}: model_type '{}' is not supported (supported: \"qwen2\" (Qwen2, Qwen2.5), \"qwen3\" (Qwen3 "
        "dense), \"llama\" (Llama 3.x); docs/models.md)",
        label, model_type);

  ModelConfig c;
  c.family = parse_family(model_type);
  c.vocab_size = get_int(j, "vocab_size", label, 0, true);
  c.hidden_size = get_int(j, "hidden_size", label, 0, true);
  c.intermediate_size = get_int(j, "intermediate_size", label, 0, true);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", label, 0, true);
  c.num_attention_heads = get_int(j, "num_attention_heads", label, 0, true);
  c.num_key_value_heads =
      get_int(j, "num_key_value_heads", label, c.num_attention_heads, false);
  // transformers' Qwen3Config defaults head_dim to 128; the others derive it.
  const std::int64_t derived_hd = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  c.head_dim = get_int(j, "head_dim", label, c.family == ModelFamily::kQwen3 ? 128 : derived_hd, false);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", label, 32768, false);
  c.rope_theta = get_num(j, "rope_theta", label, 10000.0);
  // RoPE: legacy rope_theta + rope_scaling, or transformers 5's rope_parameters (theta and type).
  const json* rope = nullptr;
  const char* rope_key = "";
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    if (!j["rope_parameters"].is_object()) throw_invalid("{}: 'rope_parameters' must be an object", label);
    rope = &j["rope_parameters"];
    rope_key = "rope_parameters";
    c.rope_theta = get_num(*rope, "rope_theta", label, c.rope_theta);
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    if (!j["rope_scaling"].is_object()) throw_invalid("{}: 'rope_scaling' must be an object", label);
    rope = &j["rope_scaling"];
    rope_key = "rope_scaling";
  }
  if (rope != nullptr) {
    const std::string type = rope_type_of(*rope);
    if (type == "llama3") {
      RopeLlama3 r;
      r.factor = get_num(*rope, "factor", label, r.factor);
      r.low_freq_factor = get_num(*rope, "low_freq_factor", label, r.low_freq_factor);
      r.high_freq_factor = get_num(*rope, "high_freq_factor", label, r.high_freq_factor);
      r.original_max_position_embeddings =
          get_int(*rope, "original_max_position_embeddings", label, r.original_max_position_embeddings, false);
      c.rope_llama3 = r;
    } else if (type != "default") {
      throw_unsupported("{}: {} of type '{}' ({}) is not supported (supported: plain RoPE and \"llama3\")", label,
                        rope_key, type, rope->dump());
    }
  }
  if (c.family == ModelFamily::kQwen2) {
    c.attention_bias = true;  // Qwen2's q/k/v always carry biases
  } else {
    c.attention_bias = get_bool(j, "attention_bias", label, false);
    if (get_bool(j, "mlp_bias", label, false))
      throw_unsupported("{}: mlp_bias true is not supported (no dense family ships MLP biases)", label);
  }
  c.qk_norm = c.family == ModelFamily::kQwen3;
  c.rms_norm_eps = get_num(j, "rms_norm_eps", label, 1e-6);
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean())
      throw_invalid("{}: 'tie_word_embeddings' must be a boolean", label);
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  } else {
    c.tie_word_embeddings = false;  // transformers ModelConfig default
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

void ModelConfig::validate(const std::string& label) const {
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
  if (rope_llama3) {
    const auto& r = *rope_llama3;
    if (!(r.factor > 0) || !(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor) ||
        r.original_max_position_embeddings <= 0)
      throw_invalid(
          "{}: llama3 RoPE scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
          "original_max_position_embeddings > 0 (got {}, {}, {}, {})",
          label, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings);
  }
  if (family == ModelFamily::kQwen2 && !attention_bias)
    throw_invalid("{}: a qwen2 model has q/k/v biases (attention_bias)", label);
}

ModelConfig ModelConfig::load(const std::filesystem::path& model_dir) {
  auto path = model_dir / "config.json";
  return from_json(read_file(path), path.string());
}

std::string ModelConfig::to_json() const {
  nlohmann::ordered_json j;
  switch (family) {
    case ModelFamily::kQwen2: j["architectures"] = {"Qwen2ForCausalLM"}; break;
    case ModelFamily::kQwen3: j["architectures"] = {"Qwen3ForCausalLM"}; break;
    case ModelFamily::kLlama: j["architectures"] = {"LlamaForCausalLM"}; break;
  }
  j["model_type"] = family_name(family);
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  if (family != ModelFamily::kLlama) j["max_window_layers"] = num_hidden_layers;
  j["rope_theta"] = rope_theta;
  if (rope_llama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rope_llama3->factor},
                         {"low_freq_factor", rope_llama3->low_freq_factor},
                         {"high_freq_factor", rope_llama3->high_freq_factor},
                         {"original_max_position_embeddings", rope_llama3->original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["rms_norm_eps"] = rms_norm_eps;
  j["hidden_act"] = "silu";
  if (family != ModelFamily::kQwen2) j["attention_bias"] = attention_bias;
  if (family == ModelFamily::kLlama) j["mlp_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = 0.02;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["torch_dtype"] = torch_dtype;
  j["use_cache"] = true;
  if (family != ModelFamily::kLlama) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = max_position_embeddings;
  }
  if (bos_token_id) j["bos_token_id"] = *bos_token_id;
  if (eos_token_ids.size() == 1) j["eos_token_id"] = eos_token_ids[0];
  else if (!eos_token_ids.empty()) j["eos_token_id"] = eos_token_ids;
  j["transformers_version"] = "4.51.0";
  return j.dump(2) + "\n";
}

ModelConfig ModelConfig::as_family(ModelFamily f) const {
  ModelConfig c = *this;
  c.family = f;
  c.attention_bias = f == ModelFamily::kQwen2;
  c.qk_norm = f == ModelFamily::kQwen3;
  c.rope_llama3.reset();
  if (f == ModelFamily::kLlama) {
    c.rope_theta = 500000.0;
    c.rope_llama3 = RopeLlama3{32.0, 1.0, 4.0, 8192};
  }
  return c;
}

ModelConfig ModelConfig::preset(const std::string& name) {
  if (name == "qwen3-tiny") return preset("tiny").as_family(ModelFamily::kQwen3);
  if (name == "llama3-tiny") return preset("tiny").as_family(ModelFamily::kLlama);
  if (name == "qwen3-small") return preset("small").as_family(ModelFamily::kQwen3);
  if (name == "llama3-small") return preset("small").as_family(ModelFamily::kLlama);
  if (name == "qwen3-1.7b-shape" || name == "qwen3-shape") {
    // Qwen3-1.7B: 28 layers, hidden 2048, MLP 6144, 16/8 heads of 128, tied, theta 1e6.
    ModelConfig c = preset("qwen2.5-1.5b-shape").as_family(ModelFamily::kQwen3);
    c.hidden_size = 2048;
    c.intermediate_size = 6144;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
    c.rope_theta = 1000000.0;
    c.eos_token_ids = {151645};
    return c;
  }
  if (name == "llama3.2-1b-shape" || name == "llama3-shape") {
    // Llama-3.2-1B: 16 layers, hidden 2048, MLP 8192, 32/8 heads of 64, tied, theta 500000 with
    // llama3 scaling (factor 32, low 1, high 4, original 8192), vocabulary 128256.
    ModelConfig c = preset("qwen2.5-1.5b-shape").as_family(ModelFamily::kLlama);
    c.vocab_size = 128256;
    c.hidden_size = 2048;
    c.intermediate_size = 8192;
    c.num_hidden_layers = 16;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 8;
    c.head_dim = 64;
    c.max_position_embeddings = 131072;
    c.rms_norm_eps = 1e-5;
    c.bos_token_id = 128000;
    c.eos_token_ids = {128001, 128008, 128009};
    return c;
  }
  ModelConfig c;
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
    throw_invalid(
        "unknown model preset '{}' (known: tiny, small, qwen2.5-1.5b-shape, qwen3-tiny, qwen3-small, "
        "qwen3-1.7b-shape, llama3-tiny, llama3-small, llama3.2-1b-shape)",
        name);
  }
  return c;
}

}  // namespace lorasync::model
