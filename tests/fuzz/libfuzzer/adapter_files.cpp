// libFuzzer: the two JSON files of an adapter directory that a replica reads from a bucket anyone
// in the run can write: adapter_config.json (model/lora_config.h) and manifest.json
// (engine/adapter_manifest.h). The same bytes go to both parsers. Only lorasync::Error may come
// out; an accepted configuration is valid (positive rank, finite alpha, targets sorted, unique)
// and round-trips through to_peft_json(); an accepted manifest keeps the rules it was checked for.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/model/lora_config.h"
#include "engine/adapter_manifest.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  using lorasync::model::LoraConfig;
  try {
    const LoraConfig c = LoraConfig::from_peft_json(text, "adapter_config.json");
    if (c.rank <= 0 || !std::isfinite(c.alpha) || c.targets.empty()) std::abort();
    for (std::size_t i = 1; i < c.targets.size(); ++i)
      if (!(c.targets[i - 1] < c.targets[i])) std::abort();
    const LoraConfig back = LoraConfig::from_peft_json(c.to_peft_json(), "round-trip");
    if (back.rank != c.rank || back.alpha != c.alpha || back.use_rslora != c.use_rslora || back.targets != c.targets ||
        back.base_model_name_or_path != c.base_model_name_or_path)
      std::abort();
  } catch (const lorasync::Error&) {
  }
  try {
    const auto m = lorasync::engine::parse_adapter_manifest(text);
    if (m.files.size() > lorasync::engine::kMaxManifestFiles) std::abort();
    for (const auto& [name, e] : m.files)
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." || e.sha256.size() != 64)
        std::abort();
  } catch (const lorasync::Error&) {
  }
  return 0;
}
