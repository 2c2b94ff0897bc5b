// core/tokenizer/bpe.h: the BPE model (tokenizers' models::bpe semantics).
//
// A piece is split into initial symbols (one per character; with ByteLevel input, one per raw
// byte), then merged pair by pair, lowest merge rank first and leftmost among equal ranks, with
// the same heap-and-linked-list procedure as the reference (Word::merge_all) so ties and stale
// entries resolve identically.
//
// Main design choices for speed: merges live in an open-addressing table keyed by the 64-bit pair
// of symbol ids (no strings at encode time); with byte-level input the vocabulary is re-keyed to
// raw bytes at load, so input bytes map to initial ids through a 256-entry table and no byte-level
// string is ever built; results for pieces up to 256 bytes are kept in a per-thread cache.
// Thread-safety: immutable after construction; encode_piece is thread-safe (the cache is
// thread-local and tagged with the model's serial number).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lorasync::tok {

struct BpeOptions {
  std::optional<std::string> unk_token;       // token for characters not in the vocabulary
  bool fuse_unk = false;                      // consecutive unknowns become one unk
  bool byte_fallback = false;                 // unknown characters as <0xNN> byte tokens
  bool ignore_merges = false;                 // a piece that is a whole vocabulary entry wins
  std::string continuing_subword_prefix;      // prefix of non-initial symbols ("" = none)
  std::string end_of_word_suffix;             // suffix of the final symbol ("" = none)
  bool byte_level_input = false;              // pieces are raw bytes; vocab is ByteLevel strings
};

class BpeModel {
 public:
  BpeModel() = default;
  // vocab: token -> id; merges: in rank order. InvalidInput naming the merge (index and tokens)
  // when one of its parts or its result is not in the vocabulary.
  BpeModel(std::unordered_map<std::string, std::int32_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options);

  // Appends the ids of one pre-tokenized piece (raw bytes when options.byte_level_input).
  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const;
  // The same without the cache (tests compare the two).
  void encode_piece_uncached(std::string_view piece, std::vector<std::int32_t>& out) const;

  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  // The vocabulary string of id ("" for ids not in the vocabulary).
  const std::string& id_to_token(std::int32_t id) const;
  // One past the largest id in the vocabulary.
  std::int32_t n_ids() const { return static_cast<std::int32_t>(id_to_token_.size()); }
  std::size_t n_merges() const { return n_merges_; }
  const BpeOptions& options() const { return opts_; }

 private:
  struct MergeEntry {
    std::uint64_t key = ~0ULL;  // (left id << 32) | right id; ~0 = empty slot
    std::uint32_t rank = 0;
    std::int32_t new_id = 0;
  };
  const MergeEntry* find_merge(std::int32_t a, std::int32_t b) const {
    const std::uint64_t key = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
                              static_cast<std::uint32_t>(b);
    std::uint64_t h = key * 0x9E3779B97F4A7C15ULL;
    std::size_t i = static_cast<std::size_t>(h >> shift_);
    for (;;) {
      const MergeEntry& e = merge_table_[i];
      if (e.key == key) return &e;
      if (e.key == ~0ULL) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  void insert_merge(std::int32_t a, std::int32_t b, std::uint32_t rank, std::int32_t new_id);
  // Initial symbols of a piece; returns false when ignore_merges found the whole piece.
  void initial_symbols(std::string_view piece, std::vector<std::int32_t>& ids,
                       std::vector<std::uint32_t>& lens) const;
  void merge_all(std::vector<std::int32_t>& ids, std::vector<std::uint32_t>& lens,
                 std::vector<std::int32_t>& out) const;

  std::unordered_map<std::string, std::int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, std::int32_t> raw_vocab_;  // raw-byte keys, for ignore_merges
  std::vector<MergeEntry> merge_table_;
  std::size_t mask_ = 0;
  int shift_ = 64;
  std::size_t n_merges_ = 0;
  BpeOptions opts_;
  bool fast_bytes_ = false;               // byte_level_input and every byte has a token
  std::int32_t byte_ids_[256] = {};
  std::optional<std::int32_t> unk_id_;
  std::uint64_t serial_ = 0;              // identifies this model to the thread-local caches
};

}  // namespace lorasync::tok
