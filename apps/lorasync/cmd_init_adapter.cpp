// `lorasync init-adapter`: a PEFT LoRA adapter for a model, published like the trainer publishes
// a version (staging directory, PEFT files, manifest.json last, rename): A Kaiming-uniform, B zero
// (the trainer's initial adapter) or, with --b-std > 0, random B (a non-trivial adapter for tests
// and demos).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>

#include "commands.h"
#include "core/model/lora.h"
#include "core/model/model_config.h"
#include "engine/adapter_store.h"
#include "util/error.h"
#include "util/files.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace {

struct InitAdapterOptions {
  std::string model, output, targets = "all-linear";
  std::int64_t rank = 1;
  double alpha = 2.0;
  std::uint64_t seed = 0;
  double b_std = 0.0;
  std::int64_t version = 1;
};

int run(const InitAdapterOptions& o) {
  auto cfg = model::ModelConfig::load(o.model);
  model::LoraConfig lc;
  lc.rank = o.rank;
  lc.alpha = o.alpha;
  lc.targets = model::LoraConfig::parse_targets(split(o.targets, ','));
  lc.base_model_name_or_path = o.model;
  auto a = model::LoraAdapter::init(lc, cfg, o.seed, at::kCPU);
  if (o.b_std > 0) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed + 1);
    for (std::int64_t l = 0; l < a.n_layers(); ++l)
      for (auto m : lc.targets) a.B(l, m).normal_(0, o.b_std, gen);
  }
  fs::path out(o.output);
  if (fs::exists(out)) throw_invalid("--output {} exists (adapter versions are immutable)", out.string());
  fs::create_directories(out.parent_path().empty() ? fs::path(".") : out.parent_path());
  fs::path staging = out.parent_path() / (".staging-" + out.filename().string() + "-" + random_hex(4));
  a.save_peft(staging, /*atomic=*/false);
  auto sha = engine::write_adapter_manifest(staging, out.filename().string(), o.version, 0, o.model, "");
  fsync_path(staging, true);
  rename_and_sync(staging, out);
  std::printf("{\"output\": \"%s\", \"adapter_sha256\": \"%s\", \"params\": %lld}\n", out.c_str(), sha.c_str(),
              static_cast<long long>(a.n_params()));
  return 0;
}

}  // namespace

void register_init_adapter(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<InitAdapterOptions>();
  auto* sub = root.add_subcommand("init-adapter", "write a PEFT LoRA adapter version with a manifest");
  sub->add_option("--model", o->model, "base model directory")->required();
  sub->add_option("--output", o->output, "adapter directory to create (its name is the version name)")->required();
  sub->add_option("--rank", o->rank, "LoRA rank r")->capture_default_str();
  sub->add_option("--alpha", o->alpha, "lora_alpha (scaling alpha / r)")->capture_default_str();
  sub->add_option("--targets", o->targets, "all-linear or a comma list of q_proj,...")->capture_default_str();
  sub->add_option("--seed", o->seed, "seed of A (and B)")->capture_default_str();
  sub->add_option("--b-std", o->b_std, "std of a random B (0 = zero, the trainer's start)")->capture_default_str();
  sub->add_option("--version", o->version, "version number recorded in manifest.json")->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
