#include "core/model/lora_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>

#include "util/error.h"

namespace lorasync::model {

namespace {

constexpr std::string_view kModuleNames[kNumLoraModules] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

}  // namespace

std::string_view lora_module_name(LoraModule m) { return kModuleNames[static_cast<int>(m)]; }

std::optional<LoraModule> parse_lora_module(std::string_view name) {
  for (int i = 0; i < kNumLoraModules; ++i)
    if (kModuleNames[i] == name) return static_cast<LoraModule>(i);
  return std::nullopt;
}

std::pair<std::int64_t, std::int64_t> lora_module_shape(const ModelConfig& c, LoraModule m) {
  const auto d = c.hidden_size;
  switch (m) {
    case LoraModule::kQ: return {d, c.q_dim()};
    case LoraModule::kK:
    case LoraModule::kV: return {d, c.kv_dim()};
    case LoraModule::kO: return {c.q_dim(), d};
    case LoraModule::kGate:
    case LoraModule::kUp: return {d, c.intermediate_size};
    case LoraModule::kDown: return {c.intermediate_size, d};
  }
  return {0, 0};
}

double LoraConfig::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

bool LoraConfig::targets_module(LoraModule m) const {
  for (auto t : targets)
    if (t == m) return true;
  return false;
}

std::vector<LoraModule> LoraConfig::parse_targets(const std::vector<std::string>& names) {
  std::vector<LoraModule> out;
  auto add = [&](LoraModule m) {
    for (auto t : out)
      if (t == m) return;
    out.push_back(m);
  };
  for (const auto& raw : names) {
    std::string n = raw;
    if (n == "all-linear") {
      for (int i = 0; i < kNumLoraModules; ++i) add(static_cast<LoraModule>(i));
      continue;
    }
    // Accept "q", "q_proj" and dotted paths ending in a module name.
    if (auto dot = n.rfind('.'); dot != std::string::npos) n = n.substr(dot + 1);
    auto m = parse_lora_module(n);
    if (!m) m = parse_lora_module(n + "_proj");
    if (!m)
      throw_invalid(
          "LoRA target module '{}' is not supported (use q_proj, k_proj, v_proj, o_proj, "
          "gate_proj, up_proj, down_proj or all-linear)",
          raw);
    add(*m);
  }
  if (out.empty()) throw_invalid("LoRA target_modules is empty");
  std::sort(out.begin(), out.end());
  return out;
}

LoraConfig LoraConfig::from_peft_json(const std::string& text, const std::string& label) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw_invalid("{}: not valid JSON: {}", label, e.what());
  }
  if (!j.is_object()) throw_invalid("{}: must be a JSON object", label);
  // Typed reads: a key of the wrong type is refused by name (absent or null: the default).
  auto present = [&](const char* k) { return j.contains(k) && !j[k].is_null(); };
  auto boolean = [&](const char* k, bool dflt) {
    if (!present(k)) return dflt;
    if (!j[k].is_boolean()) throw_invalid("{}: '{}' must be true or false, got {}", label, k, j[k].dump().substr(0, 60));
    return j[k].get<bool>();
  };
  auto string = [&](const char* k, const std::string& dflt) {
    if (!present(k)) return dflt;
    if (!j[k].is_string()) throw_invalid("{}: '{}' must be a string, got {}", label, k, j[k].dump().substr(0, 60));
    return j[k].get<std::string>();
  };
  LoraConfig c;
  const std::string peft_type = string("peft_type", "LORA");
  if (peft_type != "LORA") throw_invalid("{}: peft_type '{}' is not LORA", label, peft_type);
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<std::int64_t>() <= 0)
    throw_invalid("{}: 'r' must be a positive integer", label);
  c.rank = j["r"].get<std::int64_t>();
  if (present("lora_alpha")) {
    if (!j["lora_alpha"].is_number()) throw_invalid("{}: 'lora_alpha' must be a number", label);
    c.alpha = j["lora_alpha"].get<double>();
    if (!std::isfinite(c.alpha)) throw_invalid("{}: 'lora_alpha' must be finite", label);
  } else {
    c.alpha = 8;  // PEFT's default
  }
  if (boolean("use_dora", false)) throw_invalid("{}: DoRA adapters (use_dora) are not supported", label);
  if (present("modules_to_save") && !(j["modules_to_save"].is_array() && j["modules_to_save"].empty()))
    throw_invalid("{}: modules_to_save {} is not supported (only LoRA deltas can be served)", label,
                  j["modules_to_save"].dump().substr(0, 200));
  if (const std::string bias = string("bias", "none"); bias != "none")
    throw_invalid("{}: bias '{}' is not supported (only \"none\")", label, bias);
  if (boolean("fan_in_fan_out", false)) throw_invalid("{}: fan_in_fan_out adapters are not supported", label);
  for (const char* k : {"rank_pattern", "alpha_pattern"})
    if (present(k) && !(j[k].is_object() && j[k].empty()))
      throw_invalid("{}: '{}' is not supported (one rank and alpha for every module)", label, k);
  if (present("layers_to_transform")) throw_invalid("{}: 'layers_to_transform' is not supported", label);
  // Inference ignores dropout (the trainer refuses a non-zero one itself); it must still be a number.
  if (present("lora_dropout") && !j["lora_dropout"].is_number()) throw_invalid("{}: 'lora_dropout' must be a number", label);
  c.use_rslora = boolean("use_rslora", false);
  std::vector<std::string> names;
  if (!present("target_modules")) throw_invalid("{}: 'target_modules' is missing", label);
  if (j["target_modules"].is_string()) {
    names.push_back(j["target_modules"].get<std::string>());
  } else if (j["target_modules"].is_array()) {
    for (const auto& t : j["target_modules"]) {
      if (!t.is_string()) throw_invalid("{}: target_modules entries must be strings", label);
      names.push_back(t.get<std::string>());
    }
  } else {
    throw_invalid("{}: target_modules must be a string or a list", label);
  }
  c.targets = parse_targets(names);
  c.base_model_name_or_path = string("base_model_name_or_path", "");
  return c;
}

std::string LoraConfig::to_peft_json() const {
  nlohmann::ordered_json j;
  std::vector<std::string> names;
  for (auto t : targets) names.emplace_back(lora_module_name(t));
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] = base_model_name_or_path;
  j["r"] = rank;
  j["lora_alpha"] = alpha;
  j["lora_dropout"] = 0.0;
  j["target_modules"] = names;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["use_dora"] = false;
  j["use_rslora"] = use_rslora;
  j["modules_to_save"] = nullptr;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["revision"] = nullptr;
  return j.dump(2) + "\n";
}

}  // namespace lorasync::model
