#include "model_options.h"

#include <filesystem>

#include "core/model/runtime.h"
#include "util/log.h"

namespace lorasync::cli {

void add_model_options(CLI::App* app, ModelOptions& o, bool with_adapter) {
  app->add_option("--model", o.model_dir, "model directory (config.json, *.safetensors)")->required();
  if (with_adapter) app->add_option("--adapter", o.adapter_dir, "PEFT LoRA adapter directory");
  app->add_option("--dtype", o.dtype, "auto|float32|bfloat16|float16 (auto: fp32 on CPU)")
      ->capture_default_str();
  app->add_option("--device", o.device, "cpu|cuda|cuda:N")->capture_default_str();
  app->add_option("--threads", o.threads, "compute threads (0 = all cores)")->capture_default_str();
}

LoadedModel load_model(const ModelOptions& o) {
  model::set_compute_threads(o.threads);
  auto device = model::parse_device(o.device);
  auto dtype = model::parse_dtype(o.dtype, device, "--dtype");
  LoadedModel out;
  out.model = model::DecoderModel::load(o.model_dir, dtype, device);
  if (!o.adapter_dir.empty())
    out.adapter = std::make_unique<model::LoraAdapter>(
        model::LoraAdapter::load_peft(o.adapter_dir, out.model->config(), device));
  LS_LOG_DEBUG("model", "loaded {} ({} layers, {}) on {}", o.model_dir,
               out.model->config().num_hidden_layers, model::dtype_name(dtype), device.str());
  return out;
}

std::string default_tokenizer_dir() {
  namespace fs = std::filesystem;
  for (fs::path p : {fs::path("../shared/data/qwen2-tokenizer"),
                     fs::path(LORASYNC_SOURCE_DIR) / "../shared/data/qwen2-tokenizer"})
    if (fs::exists(p / "tokenizer.json")) return fs::weakly_canonical(p).string();
  return "";
}

}  // namespace lorasync::cli
