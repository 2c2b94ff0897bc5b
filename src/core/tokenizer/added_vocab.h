// core/tokenizer/added_vocab.h: added tokens, matched in the text before pre-tokenisation.
//
// Semantics follow tokenizers' AddedVocabulary: tokens with normalized=false are matched in the raw
// text, tokens with normalized=true in each normalized remaining piece (against their normalized
// content); matching is leftmost-longest and non-overlapping; single_word discards a match touching
// a word character (\w) on either side; lstrip / rstrip absorb the whitespace before / after a
// match into it (never reaching into the previous match). With parse_special=false special tokens
// are skipped (their text is tokenized as ordinary text), like encode_special_tokens=true.
// Thread-safety: immutable after construction; split() is thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::tok {

struct AddedToken {
  std::string content;       // the token's text
  std::int32_t id = 0;
  bool special = false;      // skipped by decode(skip_special) and by parse_special=false
  bool single_word = false;  // only match as a whole word
  bool lstrip = false;       // swallow whitespace on the left
  bool rstrip = false;       // swallow whitespace on the right
  bool normalized = false;   // match against normalized text
};

// A part of the text: an added token (id >= 0) or plain text to tokenize (id == -1).
struct TextSegment {
  std::uint32_t begin = 0;
  std::uint32_t end = 0;
  std::int32_t id = -1;
};

// A set of token strings matched leftmost-longest (a byte trie with a first-byte filter).
class TokenMatcher {
 public:
  // patterns[i] is the text matched for tokens[i] (empty patterns never match).
  TokenMatcher(const std::vector<AddedToken>& tokens, const std::vector<std::string>& patterns);
  TokenMatcher() = default;
  bool empty() const { return nodes_.size() <= 1; }
  // Appends the segments of s; an empty s yields one empty plain segment.
  void split(std::string_view s, bool parse_special, std::vector<TextSegment>& out) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, std::int32_t>> children;
    std::int32_t token = -1;  // index into tokens_ when a pattern ends here
  };
  std::int32_t child(std::int32_t node, unsigned char c) const;
  std::vector<Node> nodes_;
  std::vector<AddedToken> tokens_;
  bool first_byte_[256] = {};
};

}  // namespace lorasync::tok
