// `lorasync generate`: one sequence through prefill and cached decode, for smoke tests and the
// README's first command. Prints {"ids": [...], "logprobs": [...], "finish_reason": ...}.
#include <nlohmann/json.hpp>

#include <cstdio>

#include "commands.h"
#include "core/model/logprobs.h"
#include "model_options.h"
#include "util/error.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace {

struct GenerateCmdOptions {
  ModelOptions model;
  std::string prompt_ids;
  std::int64_t max_tokens = 16;
  double temperature = 0.0;
  std::uint64_t seed = 0;
  bool ignore_eos = false;
};

int run(const GenerateCmdOptions& o) {
  if (o.max_tokens < 1) throw_invalid("--max-tokens must be at least 1, got {}", o.max_tokens);
  auto prompt = parse_int_list(o.prompt_ids, "--prompt-ids");
  auto lm = load_model(o.model);
  model::GenerateOptions g;
  g.max_new_tokens = o.max_tokens;
  g.temperature = o.temperature;
  g.seed = o.seed;
  if (!o.ignore_eos) g.stop_ids = lm.model->config().eos_token_ids;
  auto r = model::generate(*lm.model, lm.adapter.get(), prompt, g);
  nlohmann::json j = {{"ids", r.ids}, {"logprobs", r.logprobs},
                      {"finish_reason", r.stopped ? "stop" : "length"}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

void register_generate(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<GenerateCmdOptions>();
  auto* sub = root.add_subcommand("generate", "generate from token ids (one sequence, KV cache)");
  add_model_options(sub, o->model);
  sub->add_option("--prompt-ids", o->prompt_ids, "comma-separated prompt token ids")->required();
  sub->add_option("--max-tokens", o->max_tokens, "tokens to generate")->capture_default_str();
  sub->add_option("--temperature", o->temperature, "0 = greedy")->capture_default_str();
  sub->add_option("--seed", o->seed, "sampling seed")->capture_default_str();
  sub->add_flag("--ignore-eos", o->ignore_eos, "do not stop at the model's EOS ids");
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
