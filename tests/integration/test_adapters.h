// tests/integration/test_adapters.h: a PEFT adapter with a manifest for the serve tests, its B
// drawn from a seed so that it changes the outputs (PEFT's own initialisation leaves B at zero).
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include "core/model/lora.h"
#include "core/model/model_config.h"
#include "engine/adapter_store.h"

namespace lorasync::testing {

// Writes dir/name (rank 4, alpha 8, all linear layers of `base`) and returns its path.
inline std::string write_test_adapter(const std::filesystem::path& dir, const std::string& name, std::uint64_t seed,
                                      const model::ModelConfig& base, const std::string& base_name = "tiny") {
  model::LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.targets = model::LoraConfig::parse_targets({"all-linear"});
  auto a = model::LoraAdapter::init(lc, base, seed, at::kCPU);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (std::int64_t l = 0; l < a.n_layers(); ++l)
    for (auto m : lc.targets) a.B(l, m).normal_(0, 0.1, gen);
  a.save_peft(dir / name);
  engine::write_adapter_manifest(dir / name, name, 1, 0, base_name, "");
  return (dir / name).string();
}

}  // namespace lorasync::testing
