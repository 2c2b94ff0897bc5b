// libFuzzer: the two JSON files of an adapter directory that a replica reads from a bucket anyone
// in the run can write: adapter_config.json (model/lora_config.h) and manifest.json
// (core/io/adapter_manifest.h), and the push bundle a replica receives over HTTP. The same bytes
// go to all three parsers. An accepted bundle's files add up to the body and it re-encodes to a
// bundle that parses to the same name, files and digest. Only lorasync::Error may come
// out; an accepted configuration is valid (positive rank, finite alpha, targets sorted, unique)
// and round-trips through to_peft_json(); an accepted manifest keeps the rules it was checked for.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "core/io/adapter_manifest.h"
#include "core/model/lora_config.h"
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
    const auto m = lorasync::io::parse_adapter_manifest(text);
    if (m.files.size() > lorasync::io::kMaxManifestFiles) std::abort();
    for (const auto& [name, e] : m.files)
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." || e.sha256.size() != 64)
        std::abort();
  } catch (const lorasync::Error&) {
  }
  try {
    const auto b = lorasync::io::parse_adapter_bundle(text);
    std::map<std::string, std::string> files;
    std::size_t total = 0;
    for (const auto& [name, bytes] : b.files) {
      files[name] = std::string(bytes);
      total += bytes.size();
    }
    if (total > text.size() || b.lora_name.empty()) std::abort();
    nlohmann::json m = {{"files", nlohmann::json::object()}};
    for (const auto& [name, e] : b.manifest.files) m["files"][name] = {{"bytes", e.bytes}, {"sha256", e.sha256}};
    const auto again = lorasync::io::parse_adapter_bundle(lorasync::io::make_adapter_bundle(b.lora_name, b.lora_path, m.dump(), files));
    if (again.lora_name != b.lora_name || again.lora_path != b.lora_path || again.adapter_sha256 != b.adapter_sha256 ||
        again.file_sha256 != b.file_sha256)
      std::abort();
  } catch (const lorasync::Error&) {
  }
  return 0;
}
