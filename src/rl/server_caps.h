// rl/server_caps.h: what the trainer needs to know about a generation server, read from
// `GET /server_info?config_format=json` in either shape it comes in (trainer.md §2 "Capability
// probe"): lorasync's flat object (`lora_config`, `parallel_config`, `model`, `dtype`,
// `max_model_len`, `base_model_sha256` at the top), or vLLM's, where everything sits under
// `vllm_config` (`model_config.{model, served_model_name, max_model_len, dtype}`,
// `lora_config`, `parallel_config`; dtypes as "torch.bfloat16"). A key at the top wins over the
// nested one (lorasync serve answers `config_format=json` with both, equal). Free of libtorch.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lorasync::rl {

struct ServerCaps {
  bool lora_enabled = false;  // lora_config present and not null
  std::int64_t max_loras = 0, max_lora_rank = 0;
  std::optional<std::int64_t> max_cpu_loras;              // vLLM; null or absent: no limit stated
  std::optional<std::vector<std::string>> target_modules;  // lorasync; vLLM states none
  std::int64_t data_parallel_size = 1;
  std::int64_t max_model_len = 0;  // 0: not stated
  // The name requests use: vLLM's first served_model_name, else its model; lorasync's model.
  std::string served_name;
  std::string dtype;  // "float32" | "bfloat16" | "float16" | what the server said; "" if absent
  std::optional<std::string> base_model_sha256;  // lorasync only
  std::optional<std::string> adapter_push;       // lorasync: the push bundle format it takes
  bool vllm = false;                              // the nested vLLM shape was read
};

// Throws Error(kInvalidInput) naming the key when a value has the wrong type.
ServerCaps parse_server_info(const nlohmann::json& info);

}  // namespace lorasync::rl
