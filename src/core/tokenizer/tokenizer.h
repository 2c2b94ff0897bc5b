// core/tokenizer/tokenizer.h: Hugging Face tokenizer.json (byte-level BPE), identical ids.
//
// Pipeline of encode(text), the same as Hugging Face tokenizers:
//   added tokens (raw text) -> normalizer (NFC) -> added tokens (normalized) -> pre-tokenizer
//   (Split / ByteLevel / Digits / Sequence) -> BPE per piece -> post-processor (optional)
// decode(ids) maps every token to its bytes (the ByteLevel decoder) and repairs invalid UTF-8
// with U+FFFD, as the reference does; IncrementalDecoder does the same for a stream of ids and
// only ever emits complete, valid UTF-8.
//
// Supported tokenizer.json features (anything else is an Unsupported error naming the field):
//   model: BPE (vocab; merges as "a b" strings or ["a", "b"] pairs; unk_token, fuse_unk,
//          byte_fallback, ignore_merges, continuing_subword_prefix, end_of_word_suffix)
//   normalizer: null, NFC, Sequence of those
//   pre_tokenizer: null, Split (String or Regex pattern, all five behaviours, invert), ByteLevel
//          (add_prefix_space, use_regex), Digits, Sequence
//   decoder: null, ByteLevel;  post_processor: null, ByteLevel, TemplateProcessing (single)
//   added_tokens: special, single_word, lstrip, rstrip, normalized
// tokenizer_config.json (optional, next to tokenizer.json) gives bos/eos/pad/unk and
// add_bos_token/add_eos_token.
//
// Input text must be valid UTF-8: invalid input is an InvalidInput error naming the byte offset
// (the reference only accepts Unicode strings). Malformed files are InvalidInput errors naming the
// field ("model.merges[12]").
// Thread-safety: a Tokenizer is immutable after loading; every const member function may be called
// from any number of threads at once. Copies share the loaded data. An IncrementalDecoder is
// single-threaded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/tokenizer/added_vocab.h"

namespace lorasync::tok {

struct SpecialTokens {
  std::optional<std::int32_t> bos;  // from tokenizer_config.json (bos_token), when present
  std::optional<std::int32_t> eos;  // eos_token
  std::optional<std::int32_t> pad;  // pad_token
  std::optional<std::int32_t> unk;  // unk_token
  bool add_bos = false;             // add_bos_token
  bool add_eos = false;             // add_eos_token
};

struct EncodeOptions {
  // Match special added tokens in the text ("<|im_end|>" -> one id). When false their text is
  // tokenized like any other text (non-special added tokens still match).
  bool parse_special = true;
  // Apply the post-processor (a TemplateProcessing adds its tokens); with none, add bos/eos as
  // tokenizer_config.json's add_bos_token/add_eos_token say.
  bool add_special_tokens = false;
};

class Tokenizer {
 public:
  // Loads `path`: a tokenizer.json file, or a directory holding tokenizer.json (and optionally
  // tokenizer_config.json). NotFound / InvalidInput / Unsupported with the path on failure.
  static Tokenizer load(const std::filesystem::path& path);
  // From in-memory JSON text; config_json may be empty. `origin` prefixes error messages.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json = {},
                             std::string_view origin = "tokenizer.json");

  std::vector<std::int32_t> encode(std::string_view text, const EncodeOptions& opts = {}) const;
  // Appends the ids of text to out.
  void encode_into(std::string_view text, std::vector<std::int32_t>& out,
                   const EncodeOptions& opts = {}) const;
  // Encodes each text; n_threads > 1 splits the batch over that many threads.
  std::vector<std::vector<std::int32_t>> encode_batch(std::span<const std::string> texts,
                                                      const EncodeOptions& opts = {},
                                                      int n_threads = 1) const;

  // The text of ids (invalid UTF-8 from partial tokens becomes U+FFFD). InvalidInput naming the
  // id for an id outside the vocabulary.
  std::string decode(std::span<const std::int32_t> ids, bool skip_special = false) const;

  // The bytes token `id` contributes to decoded text (may be part of a UTF-8 character).
  // InvalidInput for an unknown id.
  std::string_view token_bytes(std::int32_t id) const;
  // Vocabulary string or added-token content of `id` (the reference's id_to_token).
  std::optional<std::string> id_to_token(std::int32_t id) const;
  // Id of an added token's content or a vocabulary string.
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  bool is_valid_id(std::int32_t id) const;
  bool is_special(std::int32_t id) const;
  // One past the largest id (vocabulary and added tokens).
  std::int32_t vocab_size() const;
  const SpecialTokens& special_tokens() const;
  const std::vector<AddedToken>& added_tokens() const;
  // True when the decoder is ByteLevel (token bytes concatenate); false: tokens join with ' '.
  bool decodes_by_concatenation() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Streaming detokenizer: push ids one at a time, get text as soon as it is complete UTF-8.
// The concatenation of every push() and the final flush() equals decode(all ids).
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special = false);
  // Text completed by this id ("" while a multi-byte character is still partial).
  std::string push(std::int32_t id);
  // Whatever is left (a trailing partial character becomes U+FFFD); resets the decoder.
  std::string flush();
  // Bytes held back waiting for the rest of a character.
  std::size_t n_pending() const { return pending_.size(); }

 private:
  Tokenizer tokenizer_;
  bool skip_special_;
  bool first_ = true;
  std::string pending_;
};

}  // namespace lorasync::tok
