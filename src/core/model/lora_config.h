// core/model/lora_config.h: a LoRA adapter's configuration (PEFT's adapter_config.json) and the
// projections it may target. Free of libtorch (the fuzz target and the proxy-side tools use it).
//
// from_peft_json accepts what PEFT writes for a plain LoRA adapter and refuses, naming the key,
// every feature the engine cannot apply (DoRA, modules_to_save, rank or alpha patterns, layer
// subsets, biases, fan_in_fan_out) and every value of the wrong type: untrusted input (a bucket,
// an upload) never escapes as anything but Error(kInvalidInput).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/model/model_config.h"

namespace lorasync::model {

enum class LoraModule : int { kQ = 0, kK, kV, kO, kGate, kUp, kDown };
inline constexpr int kNumLoraModules = 7;

std::string_view lora_module_name(LoraModule m);  // "q_proj", ...
std::optional<LoraModule> parse_lora_module(std::string_view name);
// (in_features, out_features) of a module for a model configuration.
std::pair<std::int64_t, std::int64_t> lora_module_shape(const ModelConfig& c, LoraModule m);

struct LoraConfig {
  std::int64_t rank = 1;                 // r
  double alpha = 2.0;                    // lora_alpha
  bool use_rslora = false;               // scaling alpha / sqrt(r) instead of alpha / r
  std::vector<LoraModule> targets;       // targeted projections (all seven = "all-linear")
  std::string base_model_name_or_path;   // recorded in adapter_config.json

  double scaling() const;
  bool targets_module(LoraModule m) const;
  // "all-linear", a comma list, or names; InvalidInput naming the bad module.
  static std::vector<LoraModule> parse_targets(const std::vector<std::string>& names);
  // Parses and validates adapter_config.json text; `label` names the file in errors.
  static LoraConfig from_peft_json(const std::string& text, const std::string& label);
  std::string to_peft_json() const;
};

}  // namespace lorasync::model
