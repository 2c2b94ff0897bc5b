// apps/lorasync/cmd_make_demo_model.cpp: `lorasync make-demo-model`, the demo's base model and
// task (demo/demo_model.h): seeded problems, a small BPE tokenizer, a tiny Qwen2 fine-tuned on
// worked solutions, held-out accuracy. Progress on stderr, one JSON summary line on stdout.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/model/runtime.h"
#include "demo/demo_model.h"
#include "util/process.h"

namespace lorasync::cli {

namespace {

struct MakeDemoModelOptions {
  std::string out;
  int threads = 2;
  demo::DemoModelOptions d;
};

int run(MakeDemoModelOptions o) {
  configure_process();
  model::set_compute_threads(o.threads);
  o.d.out = o.out;
  auto r = demo::make_demo_model(o.d, [](const std::string& line) {
    std::fprintf(stderr, "make-demo-model: %s\n", line.c_str());
    std::fflush(stderr);
  });
  nlohmann::ordered_json j = {{"out", r.out.string()},
                              {"seed", o.d.seed},
                              {"base_accuracy", r.base_accuracy},
                              {"greedy_accuracy", r.greedy_accuracy},
                              {"boxed_rate", r.boxed_rate},
                              {"greedy_boxed_rate", r.greedy_boxed_rate},
                              {"system_prompt", o.d.system_prompt},
                              {"max_new_tokens", o.d.max_new_tokens},
                              {"vocab_size", r.vocab_size},
                              {"n_params", r.n_params},
                              {"sft_steps", o.d.sft.steps},
                              {"sft_first_loss", r.sft_first_loss},
                              {"sft_final_loss", r.sft_final_loss},
                              {"sft_seconds", r.sft_seconds},
                              {"eval_seconds", r.eval_seconds},
                              {"seconds", r.seconds}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

void register_make_demo_model(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<MakeDemoModelOptions>();
  auto& d = o->d;
  auto* sub = root.add_subcommand("make-demo-model",
                                  "make the demo's base model (tiny Qwen2 + BPE tokenizer, SFT on "
                                  "synthetic maths) and task files");
  sub->add_option("--out", o->out,
                  "output directory (model/, train.jsonl, heldout.jsonl, demo.json)")
      ->required();
  sub->add_option("--seed", d.seed, "seed of problems, weights, batch order and evaluation")
      ->capture_default_str();
  sub->add_option("--train-problems", d.train_problems, "train split size")->capture_default_str();
  sub->add_option("--heldout-problems", d.heldout_problems, "held-out split size")
      ->capture_default_str();
  sub->add_option("--steps", d.sft.steps, "SFT optimiser steps")->capture_default_str();
  sub->add_option("--threads", o->threads, "compute threads (0 = all cores)")
      ->capture_default_str();
  sub->add_flag("--overwrite", d.overwrite, "replace an existing output directory");
  // Tuning knobs (the defaults are the demo's).
  auto* g = sub->add_option_group("tuning", "model and SFT settings (defaults are the demo's)");
  g->add_option("--batch-size", d.sft.batch_size, "SFT sequences per step")->capture_default_str();
  g->add_option("--lr", d.sft.lr, "SFT peak learning rate")->capture_default_str();
  g->add_option("--warmup-steps", d.sft.warmup_steps, "SFT warm-up steps")->capture_default_str();
  g->add_option("--p-boxed", d.task.p_boxed, "share of SFT solutions ending in \\boxed{}")
      ->capture_default_str();
  g->add_option("--vocab-size", d.vocab_size, "tokenizer size")->capture_default_str();
  g->add_option("--hidden-size", d.hidden_size, "model width")->capture_default_str();
  g->add_option("--intermediate-size", d.intermediate_size, "MLP width")->capture_default_str();
  g->add_option("--layers", d.num_layers, "decoder layers")->capture_default_str();
  g->add_option("--heads", d.num_heads, "query heads")->capture_default_str();
  g->add_option("--kv-heads", d.num_kv_heads, "KV heads")->capture_default_str();
  g->add_option("--arch", d.arch, "model family: qwen2 | qwen3 (q/k norms, no biases) | llama3 (no biases, Llama 3 RoPE)")
      ->check(CLI::IsMember({"qwen2", "qwen3", "llama3"}))
      ->capture_default_str();
  g->add_option("--init-std", d.init_std, "std of the random initial weights")
      ->capture_default_str();
  g->add_option("--max-new-tokens", d.max_new_tokens, "generation cap of the evaluation")
      ->capture_default_str();
  g->add_option("--system-prompt", d.system_prompt, "system prompt of the chatml prompts")
      ->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
