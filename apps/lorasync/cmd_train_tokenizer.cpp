// `lorasync train-tokenizer`: learn a small byte-level BPE tokenizer (Qwen2-style tokenizer.json +
// tokenizer_config.json) from text files; deterministic. Used for the demo's tiny model.
#include <nlohmann/json.hpp>

#include <cstdio>

#include "commands.h"
#include "core/tokenizer/bpe_trainer.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::cli {

namespace {

struct TrainTokenizerOptions {
  std::vector<std::string> inputs;    // corpus text files (concatenated)
  std::string output;                 // directory to write tokenizer.json + tokenizer_config.json
  int vocab_size = 512;               // total ids, special tokens included
  int min_frequency = 2;              // rarer pairs are not merged
  std::vector<std::string> special = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  std::string eos_token;              // default <|im_end|> when listed
  std::string pad_token;              // default <|endoftext|> when listed
};

int run(const TrainTokenizerOptions& o) {
  std::string corpus;
  for (const auto& path : o.inputs) {
    corpus += read_file(path);
    if (!corpus.empty() && corpus.back() != '\n') corpus.push_back('\n');
  }
  tok::BpeTrainerOptions t;
  t.vocab_size = o.vocab_size;
  t.min_frequency = o.min_frequency;
  t.special_tokens = o.special;
  t.eos_token = o.eos_token;
  t.pad_token = o.pad_token;
  auto trained = tok::train_bpe(corpus, t);
  fs::create_directories(o.output);
  write_file_atomic(fs::path(o.output) / "tokenizer.json", trained.tokenizer_json);
  write_file_atomic(fs::path(o.output) / "tokenizer_config.json", trained.config_json);
  nlohmann::json summary = {{"output", o.output},
                            {"vocab_size", trained.vocab_size},
                            {"n_merges", trained.n_merges},
                            {"corpus_bytes", corpus.size()}};
  std::puts(summary.dump().c_str());
  return 0;
}

}  // namespace

void register_train_tokenizer(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<TrainTokenizerOptions>();
  auto* sub = root.add_subcommand("train-tokenizer", "learn a small byte-level BPE tokenizer.json");
  sub->add_option("--input", o->inputs, "corpus text file(s)")->required()->check(CLI::ExistingFile);
  sub->add_option("--output", o->output, "output directory")->required();
  sub->add_option("--vocab-size", o->vocab_size, "total vocabulary size")->capture_default_str();
  sub->add_option("--min-frequency", o->min_frequency, "minimum pair count to merge")
      ->capture_default_str();
  sub->add_option("--special", o->special, "comma-separated special tokens")
      ->delimiter(',')
      ->capture_default_str();
  sub->add_option("--eos-token", o->eos_token, "eos token (one of --special)");
  sub->add_option("--pad-token", o->pad_token, "pad token (one of --special)");
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
