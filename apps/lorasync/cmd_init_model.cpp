// `lorasync init-model`: a random model in Hugging Face format (config.json, safetensors, the
// tokenizer files), from a preset or a config file. Written to a staging directory and renamed,
// so an interrupted run never leaves a half-written model under the final name.
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "core/io/checkpoint_dir.h"
#include "core/model/decoder_model.h"
#include "core/model/runtime.h"
#include "model_options.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/strings.h"
#include "util/bench_report.h"

namespace lorasync::cli {

namespace {

namespace fs = std::filesystem;

struct InitModelOptions {
  std::string preset = "tiny";
  std::string config_file;
  std::string arch;  // "" = the preset's or config's family
  std::string output;
  std::string tokenizer;  // "" = shipped Qwen2 tokenizer, "none" = no tokenizer files
  std::uint64_t seed = 0;
  std::string dtype;      // "" = the preset's torch_dtype
  std::string max_shard_size = "2GiB";
  double init_std = 0.02;
  std::int64_t vocab_size = 0;  // 0 = the preset's
  bool overwrite = false;
};

// Highest token id of a tokenizer.json (model vocab and added tokens), and the ids of named
// special tokens, to check the vocabulary fits and to fill bos/eos in config.json.
struct TokenizerInfo {
  std::int64_t max_id = -1;
  std::map<std::string, std::int64_t> ids;
};

TokenizerInfo read_tokenizer_info(const fs::path& dir) {
  TokenizerInfo info;
  auto j = nlohmann::json::parse(read_file(dir / "tokenizer.json"));
  if (j.contains("model") && j["model"].contains("vocab") && j["model"]["vocab"].is_object())
    for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it) {
      info.max_id = std::max(info.max_id, it.value().get<std::int64_t>());
      info.ids[it.key()] = it.value().get<std::int64_t>();
    }
  if (j.contains("added_tokens") && j["added_tokens"].is_array())
    for (const auto& t : j["added_tokens"]) {
      auto id = t.value("id", std::int64_t{-1});
      info.max_id = std::max(info.max_id, id);
      info.ids[t.value("content", std::string())] = id;
    }
  return info;
}

std::optional<std::int64_t> special_id(const nlohmann::json& cfg, const char* key,
                                       const TokenizerInfo& info) {
  if (!cfg.contains(key) || cfg[key].is_null()) return std::nullopt;
  std::string s = cfg[key].is_string() ? cfg[key].get<std::string>()
                                       : cfg[key].value("content", std::string());
  auto it = info.ids.find(s);
  if (it == info.ids.end()) return std::nullopt;
  return it->second;
}

int run(const InitModelOptions& o) {
  model::ModelConfig cfg =
      o.config_file.empty()
          ? model::ModelConfig::preset(o.preset)
          : model::ModelConfig::from_json(read_file(o.config_file), o.config_file);
  if (!o.arch.empty()) cfg = cfg.as_family(model::parse_family(o.arch));
  if (o.vocab_size > 0) cfg.vocab_size = o.vocab_size;
  if (!o.dtype.empty()) {
    auto dt = model::parse_dtype(o.dtype, c10::Device(c10::kCPU), "--dtype");
    cfg.torch_dtype = model::dtype_name(dt);
  }
  const auto dtype = model::parse_dtype(cfg.torch_dtype, c10::Device(c10::kCPU), "torch_dtype");

  std::string tok = o.tokenizer.empty() ? default_tokenizer_dir() : o.tokenizer;
  if (o.tokenizer.empty() && tok.empty())
    throw_invalid("no tokenizer given and ../shared/data/qwen2-tokenizer not found; pass "
                  "--tokenizer DIR or --tokenizer none");
  if (tok == "none") tok.clear();
  if (!tok.empty()) {
    if (fs::is_regular_file(tok)) tok = fs::path(tok).parent_path().string();
    if (!fs::exists(fs::path(tok) / "tokenizer.json"))
      throw_invalid("--tokenizer {}: no tokenizer.json there", tok);
    auto info = read_tokenizer_info(tok);
    if (info.max_id >= cfg.vocab_size)
      throw_invalid("tokenizer {} has ids up to {} but vocab_size is {}; raise --vocab-size", tok,
                    info.max_id, cfg.vocab_size);
    fs::path tc = fs::path(tok) / "tokenizer_config.json";
    if (fs::exists(tc)) {
      auto tj = nlohmann::json::parse(read_file(tc));
      if (auto eos = special_id(tj, "eos_token", info)) cfg.eos_token_ids = {*eos};
      if (auto bos = special_id(tj, "bos_token", info)) cfg.bos_token_id = *bos;
      else cfg.bos_token_id.reset();
    }
  }
  cfg.validate("init-model");

  fs::path out(o.output);
  if (fs::exists(out)) {
    if (!o.overwrite) throw_invalid("--output {} exists; pass --overwrite to replace it", out.string());
  }
  fs::create_directories(out.has_parent_path() ? out.parent_path() : fs::path("."));
  fs::path staging = out.string() + ".staging-" + random_hex(4);
  fs::create_directories(staging);
  try {
    const double t0 = now_seconds();
    auto weights = model::random_weights(cfg, o.seed, dtype, o.init_std);
    std::vector<io::TensorToWrite> ts;
    std::vector<at::Tensor> keep;
    io::DType dt = dtype == at::kFloat ? io::DType::kF32
                   : dtype == at::kBFloat16 ? io::DType::kBF16 : io::DType::kF16;
    for (auto& [name, t] : weights) {
      auto c = t.contiguous();
      keep.push_back(c);
      ts.push_back({name, dt, c.sizes().vec(),
                    {static_cast<const std::uint8_t*>(c.data_ptr()), static_cast<std::size_t>(c.nbytes())}});
    }
    weights.clear();
    int n_files = io::write_weights(staging, ts, parse_bytes(o.max_shard_size, "--max-shard-size"));
    keep.clear();
    write_file_durable(staging / "config.json", cfg.to_json());
    nlohmann::ordered_json gen = {{"bos_token_id", cfg.bos_token_id ? nlohmann::json(*cfg.bos_token_id) : nlohmann::json(nullptr)},
                                  {"eos_token_id", cfg.eos_token_ids},
                                  {"do_sample", true}, {"temperature", 1.0}, {"top_p", 1.0}};
    write_file_durable(staging / "generation_config.json", gen.dump(2) + "\n");
    if (!tok.empty())
      for (const char* f : {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                            "special_tokens_map.json"})
        if (fs::exists(fs::path(tok) / f))
          write_file_durable(staging / f, read_file(fs::path(tok) / f));
    fsync_path(staging, true);
    if (fs::exists(out)) fs::remove_all(out);
    rename_and_sync(staging, out);
    nlohmann::ordered_json r = {{"output", out.string()},
                                {"params", cfg.n_params()},
                                {"dtype", cfg.torch_dtype},
                                {"files", n_files},
                                {"seconds", now_seconds() - t0}};
    std::printf("%s\n", r.dump().c_str());
  } catch (...) {
    std::error_code ec;
    fs::remove_all(staging, ec);
    throw;
  }
  return 0;
}

}  // namespace

void register_init_model(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<InitModelOptions>();
  auto* sub = root.add_subcommand("init-model", "write a random model in Hugging Face format");
  sub->add_option("--preset", o->preset,
                  "tiny | small (~100M) | qwen2.5-1.5b-shape | qwen3-tiny | qwen3-1.7b-shape | llama3-tiny | "
                  "llama3.2-1b-shape")
      ->capture_default_str();
  sub->add_option("--arch", o->arch,
                  "qwen2 | qwen3 | llama3: the preset's (or config's) shape as that family (qwen3: q/k norms, no "
                  "biases; llama3: no biases, Llama 3 RoPE)");
  sub->add_option("--config", o->config_file, "a config.json to use instead of a preset");
  sub->add_option("--output", o->output, "output directory")->required();
  sub->add_option("--tokenizer", o->tokenizer,
                  "tokenizer directory to copy (default ../shared/data/qwen2-tokenizer; 'none')");
  sub->add_option("--seed", o->seed, "random seed")->capture_default_str();
  sub->add_option("--dtype", o->dtype, "float32|bfloat16|float16 on disk (default: the preset's)");
  sub->add_option("--max-shard-size", o->max_shard_size, "shard above this size")->capture_default_str();
  sub->add_option("--init-std", o->init_std, "std of the random weight matrices")->capture_default_str();
  sub->add_option("--vocab-size", o->vocab_size, "override vocab_size (0 = preset)");
  sub->add_flag("--overwrite", o->overwrite, "replace an existing output directory");
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
