// core/tokenizer/bpe_trainer.h: learns a small byte-level BPE tokenizer from a text corpus.
//
// The result is a Qwen2-style tokenizer.json (NFC, the Qwen2 Split regex + ByteLevel, BPE with
// ["a", "b"] merges, ByteLevel decoder) that Hugging Face tokenizers loads as is, plus a
// tokenizer_config.json (eos/pad, the ChatML template). The demo's tiny model uses it.
//
// Algorithm: classic BPE on pre-tokenized words weighted by frequency. The vocabulary starts with
// the 256 bytes (ids 0..255, in byte order), then each step merges the most frequent adjacent
// pair (ties: the smaller left token, then the smaller right token, bytewise) until vocab_size is
// reached or no pair occurs min_frequency times. Pair counts are updated incrementally (only the
// words containing the merged pair are revisited) with a lazily validated max-heap.
// Deterministic: the same corpus and options give byte-identical files.
// Thread-safety: pure function.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace lorasync::tok {

struct BpeTrainerOptions {
  int vocab_size = 512;                     // total ids: 256 bytes + merges + special tokens
  int min_frequency = 2;                    // a pair seen fewer times is never merged
  std::vector<std::string> special_tokens;  // appended after the learned tokens, special=true
  std::string eos_token;                    // "" = <|im_end|> if listed, else the first special
  std::string pad_token;                    // "" = <|endoftext|> if listed, else eos
};

struct TrainedBpe {
  std::string tokenizer_json;   // the tokenizer.json text
  std::string config_json;      // the tokenizer_config.json text
  int n_merges = 0;             // merges learned
  int vocab_size = 0;           // ids in total, special tokens included
};

// InvalidInput when vocab_size cannot hold the bytes and special tokens, or the corpus is not
// valid UTF-8 (the offset is named).
TrainedBpe train_bpe(std::string_view corpus, const BpeTrainerOptions& options);

}  // namespace lorasync::tok
