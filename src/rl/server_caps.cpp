#include "rl/server_caps.h"

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace lorasync::rl {

namespace {

using nlohmann::json;

// `key` at the top of the object, else at `nested` (a JSON pointer under vllm_config), else null.
const json* pick(const json& info, const char* key, const char* nested) {
  if (info.contains(key)) return &info[key];
  if (nested && info.contains("vllm_config") && info["vllm_config"].is_object()) {
    const json::json_pointer p(nested);
    if (info["vllm_config"].contains(p)) return &info["vllm_config"][p];
  }
  return nullptr;
}

std::int64_t integer(const json& v, const std::string& what) {
  if (!v.is_number_integer() && !v.is_number_unsigned())
    throw_invalid("/server_info: {} must be an integer, got {}", what, v.dump().substr(0, 80));
  return v.get<std::int64_t>();
}

std::string normalize_dtype(std::string d) {
  if (d.rfind("torch.", 0) == 0) d = d.substr(6);
  if (d == "float" || d == "fp32") return "float32";
  if (d == "half" || d == "fp16") return "float16";
  if (d == "bf16") return "bfloat16";
  return d;
}

}  // namespace

ServerCaps parse_server_info(const json& info) {
  if (!info.is_object()) throw_invalid("/server_info: expected a JSON object");
  ServerCaps c;
  c.vllm = info.contains("vllm_config") && info["vllm_config"].is_object();
  if (const json* lora = pick(info, "lora_config", "/lora_config"); lora && !lora->is_null()) {
    if (!lora->is_object()) throw_invalid("/server_info: lora_config must be an object or null");
    c.lora_enabled = true;
    if (lora->contains("max_loras")) c.max_loras = integer((*lora)["max_loras"], "lora_config.max_loras");
    if (lora->contains("max_lora_rank")) c.max_lora_rank = integer((*lora)["max_lora_rank"], "lora_config.max_lora_rank");
    if (lora->contains("max_cpu_loras") && !(*lora)["max_cpu_loras"].is_null())
      c.max_cpu_loras = integer((*lora)["max_cpu_loras"], "lora_config.max_cpu_loras");
    if (lora->contains("target_modules") && (*lora)["target_modules"].is_array()) {
      c.target_modules.emplace();
      for (const auto& t : (*lora)["target_modules"]) {
        if (!t.is_string()) throw_invalid("/server_info: lora_config.target_modules must hold strings");
        c.target_modules->push_back(t.get<std::string>());
      }
    }
  }
  if (const json* par = pick(info, "parallel_config", "/parallel_config"); par && par->is_object() &&
                                                                            par->contains("data_parallel_size"))
    c.data_parallel_size = integer((*par)["data_parallel_size"], "parallel_config.data_parallel_size");
  if (const json* m = pick(info, "max_model_len", "/model_config/max_model_len"); m && !m->is_null())
    c.max_model_len = integer(*m, "max_model_len");
  // vLLM: served_model_name (a string, a list, or null: then the model path is the name).
  if (const json* s = pick(info, "served_model_name", "/model_config/served_model_name"); s && !s->is_null()) {
    if (s->is_string()) c.served_name = s->get<std::string>();
    else if (s->is_array() && !s->empty() && (*s)[0].is_string()) c.served_name = (*s)[0].get<std::string>();
  }
  if (c.served_name.empty())
    if (const json* m = pick(info, "model", "/model_config/model"); m && m->is_string()) c.served_name = m->get<std::string>();
  if (const json* d = pick(info, "dtype", "/model_config/dtype"); d && d->is_string()) c.dtype = normalize_dtype(d->get<std::string>());
  if (info.contains("base_model_sha256") && info["base_model_sha256"].is_string())
    c.base_model_sha256 = info["base_model_sha256"].get<std::string>();
  if (info.contains("adapter_push") && !info["adapter_push"].is_null()) {
    if (!info["adapter_push"].is_string()) throw_invalid("server_info: adapter_push must be a string or null");
    c.adapter_push = info["adapter_push"].get<std::string>();
  }
  return c;
}

}  // namespace lorasync::rl
