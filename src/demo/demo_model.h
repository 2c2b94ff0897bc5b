// demo/demo_model.h: makes the demo's base model, tokenizer and task files from a seed
// (`lorasync make-demo-model`).
//
// Steps, all deterministic for a fixed seed and thread count:
//   1. problems: train and held-out splits (task.h), never sharing a problem;
//   2. tokenizer: a byte-level BPE (bpe_trainer.h) learned on the train prompts and solutions,
//      with <|endoftext|>, <|im_start|>, <|im_end|>; <|im_end|> is the eos;
//   3. model: a tiny Qwen2 (fp32) with random weights, then full-weight SFT (sft.h) on the train
//      split's chat prompts and worked solutions (each ending with <|im_end|>);
//   4. evaluation on the held-out split with the verifier: sampled accuracy at temperature 1.0
//      (the base accuracy RL starts from) and greedy accuracy;
//   5. output, built in a staging directory next to `out` and renamed into place, so an
//      interrupted run never leaves a torn directory under the final name (its leftover
//      `out.staging-*` directory is removed by the next run):
//        out/model/        config.json, generation_config.json, model.safetensors,
//                          tokenizer.json, tokenizer_config.json (Hugging Face format)
//        out/train.jsonl   {"problem", "answer"} rows (the RL prompts)
//        out/heldout.jsonl held-out rows (evaluation)
//        out/demo.json     system prompt, max_new_tokens, accuracies, seed, sizes, format_version
//        out/base_samples.jsonl  the held-out completions of the evaluation (sampled, greedy)
// Thread-safety: one call at a time per output directory; sets no process-wide state (the
// caller sets compute threads).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "demo/sft.h"
#include "demo/task.h"

namespace lorasync::demo {

// The format of demo.json and the directory layout above.
constexpr int kDemoFormatVersion = 1;
// The system prompt the demo's trainer and evaluation use with the chatml prompt format.
extern const char kDemoSystemPrompt[];

struct DemoModelOptions {
  std::filesystem::path out;  // output directory (must not exist unless overwrite)
  bool overwrite = false;     // replace an existing `out`
  std::uint64_t seed = 1;
  std::int64_t train_problems = 16000;  // train split size (SFT corpus and RL prompts)
  std::int64_t heldout_problems = 256;  // held-out split size (evaluation)
  std::string system_prompt = kDemoSystemPrompt;
  std::int64_t max_new_tokens = 64;  // generation cap for evaluation (and the demo)
  TaskOptions task;                  // share of boxed solutions in the SFT corpus
  // Tokenizer and model shape.
  int vocab_size = 384;  // total ids, 3 special tokens included
  std::int64_t hidden_size = 128;
  std::int64_t intermediate_size = 256;
  std::int64_t num_layers = 2;
  std::int64_t num_heads = 4;  // query heads of hidden_size / num_heads
  std::int64_t num_kv_heads = 2;
  std::string arch = "qwen2";  // model family: qwen2 | qwen3 | llama3 (ModelConfig::as_family)
  double init_std = 0.05;  // std of the random weight matrices (0.02 learns ~3x slower)
  SftOptions sft;          // steps, batch, learning rate (seed = seed)
};

struct DemoModelResult {
  std::filesystem::path out;
  double base_accuracy = 0;    // held-out, sampled at temperature 1.0
  double greedy_accuracy = 0;  // held-out, greedy
  double boxed_rate = 0;       // sampled completions with a \boxed{}
  double greedy_boxed_rate = 0;
  double sampled_mean_tokens = 0;
  double sft_first_loss = 0, sft_final_loss = 0;
  std::int64_t n_params = 0;
  int vocab_size = 0;
  double sft_seconds = 0, eval_seconds = 0, seconds = 0;
  std::string demo_json;  // the text written to out/demo.json
};

// `log` receives progress lines (no trailing newline). InvalidInput for bad options or an
// existing `out` without overwrite; Environment for I/O failures (the staging dir is removed).
DemoModelResult make_demo_model(const DemoModelOptions& options,
                                const std::function<void(const std::string&)>& log = {});

}  // namespace lorasync::demo
