// core/tokenizer/pretokenizer.h: splitting normalized text into the pieces BPE sees.
//
// Hugging Face semantics (tokenizers' Split / ByteLevel / Digits / Sequence pre-tokenizers):
// a pattern yields non-overlapping leftmost-first matches; the behaviour decides what becomes a
// piece (Isolated: matches and the gaps between them; Removed: gaps only; MergedWithPrevious /
// MergedWithNext: each match glued to its neighbour; Contiguous: runs of like kind); `invert`
// swaps match and gap; empty pieces are dropped.
//
// Main design choice: the regexes that matter in practice — Qwen2's, Llama 3's and GPT-2's
//   Qwen2: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//          \s*[\r\n]+|\s+(?!\S)|\s+
//   Llama 3: the same with \p{N}{1,3} for \p{N}
//   GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// — are recognised by their exact text and run by hand-written scanners that reproduce the
// regex engine's leftmost-first backtracking alternative by alternative (about 10x faster than a
// JIT regex, no allocation). The conformance test checks them against the reference on every
// code point. Any other pattern goes through PCRE2 (UTF + UCP, JIT when available), whose
// classes are those of the system library's Unicode version (Debian 12's PCRE2 10.42: Unicode
// 14.0, and its \s also matches U+180E), not the reference's Unicode 16.0: letters and digits
// added since Unicode 14 split differently there. The scanners use lorasync's Unicode 16 tables.
// Thread-safety: SplitPattern and PreTokenizer are immutable after construction; all const
// member functions are thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::tok {

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Span {
  std::uint32_t begin = 0;  // byte offsets into the searched text
  std::uint32_t end = 0;
};

class SplitPattern {
 public:
  enum class Kind { kLiteral, kQwen2, kLlama3, kGpt2, kRegex, kAsciiDigit };

  // A literal string (tokenizers' {"String": ...}).
  static SplitPattern literal(std::string text);
  // A regex (tokenizers' {"Regex": ...}); InvalidInput naming the pattern if it does not compile.
  static SplitPattern regex(const std::string& pattern);
  // Each ASCII digit is a match (the Digits pre-tokenizer).
  static SplitPattern ascii_digit();

  Kind kind() const { return kind_; }
  // Appends the matches in s (valid UTF-8), in order.
  void find_matches(std::string_view s, std::vector<Span>& out) const;

 private:
  struct Compiled;
  Kind kind_ = Kind::kLiteral;
  std::string literal_;
  std::shared_ptr<const Compiled> compiled_;  // PCRE2 code, for kRegex
};

// The scanners, exposed for tests: append the matches of the Qwen2 / Llama 3 / GPT-2 pattern.
void scan_qwen2(std::string_view s, std::vector<Span>& out);
void scan_llama3(std::string_view s, std::vector<Span>& out);
void scan_gpt2(std::string_view s, std::vector<Span>& out);

// Applies a split to s and appends the resulting non-empty pieces (views into s).
void split_pieces(std::string_view s, const SplitPattern& pattern, SplitBehavior behavior,
                  bool invert, std::vector<Span>& scratch, std::vector<std::string_view>& out);

struct PreTokenizerStep {
  enum class Type { kSplit, kByteLevel };
  Type type = Type::kSplit;
  // kSplit
  SplitPattern pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // kByteLevel: the byte mapping itself is done by the model (it works on raw bytes).
  bool add_prefix_space = false;  // prepend ' ' to each piece that does not start with one
  bool use_regex = true;          // split with the GPT-2 pattern
};

class PreTokenizer {
 public:
  PreTokenizer() = default;
  explicit PreTokenizer(std::vector<PreTokenizerStep> steps) : steps_(std::move(steps)) {}
  bool empty() const { return steps_.empty(); }
  bool has_byte_level() const;
  const std::vector<PreTokenizerStep>& steps() const { return steps_; }

  // Splits `text` into pieces. Pieces view `text` or strings kept in `storage` (pieces that
  // gained a prefix space). `out` is cleared first.
  void run(std::string_view text, std::vector<std::string_view>& out,
           std::deque<std::string>& storage) const;

 private:
  std::vector<PreTokenizerStep> steps_;
};

}  // namespace lorasync::tok
