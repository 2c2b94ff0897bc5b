// core/tokenizer/tokenizer_impl.h: the loaded tokenizer's parts (private to the library).
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "core/tokenizer/added_vocab.h"
#include "core/tokenizer/bpe.h"
#include "core/tokenizer/pretokenizer.h"
#include "core/tokenizer/tokenizer.h"

namespace lorasync::tok {

struct Tokenizer::Impl {
  enum class Decoder { kNone, kByteLevel };
  BpeModel model;
  bool nfc = false;                        // the normalizer (NFC or nothing)
  PreTokenizer pre;
  std::vector<AddedToken> added;           // in file order
  TokenMatcher raw_matcher;                // added tokens with normalized=false
  TokenMatcher norm_matcher;               // added tokens with normalized=true (normalized form)
  Decoder decoder = Decoder::kNone;
  bool has_template = false;               // TemplateProcessing post-processor
  std::vector<std::int32_t> template_prefix, template_suffix;  // ids around $A
  SpecialTokens specials;
  // Per id: the decoder's bytes, and flags (1 = valid id, 2 = special added token).
  std::vector<std::string> id_bytes;
  std::vector<std::uint8_t> id_flags;
  std::unordered_map<std::string, std::int32_t> added_by_content;

  // Fills id_bytes / id_flags / added_by_content from model, added and decoder.
  void finish();
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
};

}  // namespace lorasync::tok
