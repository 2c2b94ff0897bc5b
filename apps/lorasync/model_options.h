// apps/lorasync/model_options.h: the flags every model-using subcommand shares
// (--model, --adapter, --dtype, --device, --threads) and loading from them.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "core/model/lora.h"
#include "core/model/decoder_model.h"

namespace lorasync::cli {

struct ModelOptions {
  std::string model_dir;    // Hugging Face directory
  std::string adapter_dir;  // optional PEFT adapter directory
  std::string dtype = "auto";
  std::string device = "cpu";
  int threads = 0;          // 0 = all cores
};

void add_model_options(CLI::App* app, ModelOptions& o, bool with_adapter = true);

struct LoadedModel {
  std::unique_ptr<model::DecoderModel> model;
  std::unique_ptr<model::LoraAdapter> adapter;  // null without --adapter
};

// Sets threads, parses device/dtype, loads the model and the adapter (validated against it).
LoadedModel load_model(const ModelOptions& o);

// The Qwen2 tokenizer shipped with the project: ../shared/data/qwen2-tokenizer from the current
// directory, else from the source tree. Empty when neither exists.
std::string default_tokenizer_dir();

}  // namespace lorasync::cli
