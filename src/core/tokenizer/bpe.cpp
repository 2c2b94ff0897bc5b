// core/tokenizer/bpe.cpp
#include "core/tokenizer/bpe.h"

#include <algorithm>
#include <atomic>
#include <bit>

#include "core/tokenizer/byte_level.h"
#include "core/tokenizer/unicode.h"
#include "util/error.h"

namespace lorasync::tok {

namespace {

std::atomic<std::uint64_t> g_next_serial{1};

constexpr std::size_t kMaxCachedPiece = 256;    // as the reference: longer pieces are not cached
constexpr std::size_t kCacheCapacity = 1 << 16; // entries per thread before the cache is reset

struct PieceHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept {
    // FNV-1a over 8-byte words: cheap for the short pieces that dominate.
    std::uint64_t h = 0xcbf29ce484222325ULL ^ s.size();
    std::size_t i = 0;
    for (; i + 8 <= s.size(); i += 8) {
      std::uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      h = (h ^ w) * 0x100000001b3ULL;
      h ^= h >> 29;
    }
    std::uint64_t w = 0;
    __builtin_memcpy(&w, s.data() + i, s.size() - i);
    h = (h ^ w) * 0x100000001b3ULL;
    h ^= h >> 32;
    return static_cast<std::size_t>(h);
  }
};
struct PieceEq {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const noexcept { return a == b; }
};

struct PieceCache {
  std::uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<std::int32_t>, PieceHash, PieceEq> map;
};

thread_local PieceCache t_cache;

// Heap entry of merge_all: lowest rank first, then lowest position (the reference's Ord).
struct Candidate {
  std::uint32_t rank;
  std::uint32_t pos;
  std::int32_t new_id;
};
inline bool heap_less(const Candidate& a, const Candidate& b) {
  // std heap functions build a max-heap; "less" means lower priority.
  if (a.rank != b.rank) return a.rank > b.rank;
  return a.pos > b.pos;
}

}  // namespace

BpeModel::BpeModel(std::unordered_map<std::string, std::int32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   BpeOptions options)
    : vocab_(std::move(vocab)), opts_(std::move(options)), serial_(g_next_serial++) {
  std::int32_t max_id = -1;
  for (const auto& [tok, id] : vocab_) {
    if (id < 0) throw_invalid("model.vocab[{:?}]: negative id {}", tok, id);
    max_id = std::max(max_id, id);
  }
  id_to_token_.assign(static_cast<std::size_t>(max_id + 1), std::string());
  for (const auto& [tok, id] : vocab_) id_to_token_[static_cast<std::size_t>(id)] = tok;

  std::size_t cap = std::bit_ceil(std::max<std::size_t>(16, merges.size() * 2 + 1));
  merge_table_.assign(cap, MergeEntry{});
  mask_ = cap - 1;
  shift_ = 64 - std::countr_zero(cap);
  const std::size_t prefix_len = opts_.continuing_subword_prefix.size();
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const auto& [a, b] = merges[r];
    auto ia = vocab_.find(a);
    auto ib = vocab_.find(b);
    if (ia == vocab_.end())
      throw_invalid("model.merges[{}]: token {:?} of merge ({:?}, {:?}) is not in model.vocab", r,
                    a, a, b);
    if (ib == vocab_.end())
      throw_invalid("model.merges[{}]: token {:?} of merge ({:?}, {:?}) is not in model.vocab", r,
                    b, a, b);
    if (b.size() < prefix_len)
      throw_invalid("model.merges[{}]: token {:?} is shorter than continuing_subword_prefix", r, b);
    std::string merged = a + b.substr(prefix_len);
    auto im = vocab_.find(merged);
    if (im == vocab_.end())
      throw_invalid("model.merges[{}]: result {:?} of merge ({:?}, {:?}) is not in model.vocab", r,
                    merged, a, b);
    // A repeated pair keeps the rank of its last occurrence, as a map insert in the reference.
    insert_merge(ia->second, ib->second, static_cast<std::uint32_t>(r), im->second);
  }
  n_merges_ = merges.size();

  if (opts_.unk_token) {
    auto it = vocab_.find(*opts_.unk_token);
    if (it != vocab_.end()) unk_id_ = it->second;
  }
  if (opts_.byte_level_input && prefix_len == 0 && opts_.end_of_word_suffix.empty()) {
    fast_bytes_ = true;
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      utf8_append(ch, byte_to_char(static_cast<std::uint8_t>(b)));
      auto it = vocab_.find(ch);
      if (it == vocab_.end()) {
        fast_bytes_ = false;
        break;
      }
      byte_ids_[b] = it->second;
    }
    if (fast_bytes_ && opts_.ignore_merges) {
      for (const auto& [tok, id] : vocab_)
        if (auto raw = byte_level_to_bytes(tok)) raw_vocab_.emplace(std::move(*raw), id);
    }
  }
}

void BpeModel::insert_merge(std::int32_t a, std::int32_t b, std::uint32_t rank,
                            std::int32_t new_id) {
  const std::uint64_t key = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
                            static_cast<std::uint32_t>(b);
  std::uint64_t h = key * 0x9E3779B97F4A7C15ULL;
  std::size_t i = static_cast<std::size_t>(h >> shift_);
  for (;;) {
    MergeEntry& e = merge_table_[i];
    if (e.key == ~0ULL || e.key == key) {
      e.key = key;
      e.rank = rank;
      e.new_id = new_id;
      return;
    }
    i = (i + 1) & mask_;
  }
}

std::optional<std::int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string& BpeModel::id_to_token(std::int32_t id) const {
  static const std::string kEmpty;
  if (id < 0 || static_cast<std::size_t>(id) >= id_to_token_.size()) return kEmpty;
  return id_to_token_[static_cast<std::size_t>(id)];
}

void BpeModel::initial_symbols(std::string_view piece, std::vector<std::int32_t>& ids,
                               std::vector<std::uint32_t>& lens) const {
  ids.clear();
  lens.clear();
  if (fast_bytes_) {
    for (unsigned char b : piece) {
      ids.push_back(byte_ids_[b]);
      lens.push_back(1);
    }
    return;
  }
  // Generic path: characters of the model-space string (byte-level mapped when needed).
  std::string mapped;
  std::string_view w = piece;
  if (opts_.byte_level_input) {
    mapped = bytes_to_byte_level(piece);
    w = mapped;
  }
  std::optional<std::pair<std::int32_t, std::uint32_t>> unk;  // pending (id, byte length)
  std::string s;
  for (std::size_t i = 0; i < w.size();) {
    const std::size_t len = static_cast<std::size_t>(utf8_len(static_cast<unsigned char>(w[i])));
    const bool is_first = i == 0, is_last = i + len >= w.size();
    s.clear();
    if (!is_first) s += opts_.continuing_subword_prefix;
    s.append(w.substr(i, len));
    if (is_last) s += opts_.end_of_word_suffix;
    // With byte-level input one mapped character is one input byte.
    const auto sym_len = static_cast<std::uint32_t>(opts_.byte_level_input ? 1 : len);
    i += len;
    auto it = vocab_.find(s);
    if (it != vocab_.end()) {
      if (unk) {
        ids.push_back(unk->first);
        lens.push_back(unk->second);
        unk.reset();
      }
      ids.push_back(it->second);
      lens.push_back(sym_len);
      continue;
    }
    if (opts_.byte_fallback) {
      std::vector<std::int32_t> bytes;
      bool all = true;
      for (unsigned char b : s) {
        auto bt = vocab_.find(fmt::format("<0x{:02X}>", b));
        if (bt == vocab_.end()) {
          all = false;
          break;
        }
        bytes.push_back(bt->second);
      }
      if (all) {
        for (std::int32_t b : bytes) {
          ids.push_back(b);
          lens.push_back(1);
        }
        continue;
      }
    }
    if (opts_.unk_token) {
      if (!unk_id_)
        throw_invalid("model.unk_token {:?} is not in model.vocab (needed for {:?})",
                      *opts_.unk_token, s);
      if (unk && opts_.fuse_unk) {
        unk->second += sym_len;
      } else {
        if (unk) {
          ids.push_back(unk->first);
          lens.push_back(unk->second);
        }
        unk = std::make_pair(*unk_id_, sym_len);
      }
    }
    // Without unk_token an unknown character is dropped, as in the reference.
  }
  if (unk) {
    ids.push_back(unk->first);
    lens.push_back(unk->second);
  }
}

void BpeModel::merge_all(std::vector<std::int32_t>& ids, std::vector<std::uint32_t>& lens,
                         std::vector<std::int32_t>& out) const {
  const std::size_t n = ids.size();
  if (n == 0) return;
  if (n == 1) {
    out.push_back(ids[0]);
    return;
  }
  // Doubly linked symbols; len 0 marks a symbol merged into its left neighbour.
  thread_local std::vector<std::int32_t> prev, next;
  thread_local std::vector<Candidate> heap;
  prev.resize(n);
  next.resize(n);
  heap.clear();
  for (std::size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<std::int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<std::int32_t>(i + 1) : -1;
  }
  for (std::size_t i = 0; i + 1 < n; ++i)
    if (const MergeEntry* m = find_merge(ids[i], ids[i + 1]))
      heap.push_back({m->rank, static_cast<std::uint32_t>(i), m->new_id});
  std::make_heap(heap.begin(), heap.end(), heap_less);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), heap_less);
    const Candidate top = heap.back();
    heap.pop_back();
    const std::size_t pos = top.pos;
    if (lens[pos] == 0 || next[pos] == -1) continue;
    const auto right = static_cast<std::size_t>(next[pos]);
    const MergeEntry* cur = find_merge(ids[pos], ids[right]);
    if (!cur || cur->new_id != top.new_id) continue;  // stale entry
    ids[pos] = top.new_id;
    lens[pos] += lens[right];
    lens[right] = 0;
    next[pos] = next[right];
    if (next[right] != -1) prev[static_cast<std::size_t>(next[right])] = static_cast<std::int32_t>(pos);
    if (prev[pos] != -1) {
      const auto p = static_cast<std::size_t>(prev[pos]);
      if (const MergeEntry* m = find_merge(ids[p], ids[pos])) {
        heap.push_back({m->rank, static_cast<std::uint32_t>(p), m->new_id});
        std::push_heap(heap.begin(), heap.end(), heap_less);
      }
    }
    if (next[pos] != -1) {
      const auto nx = static_cast<std::size_t>(next[pos]);
      if (const MergeEntry* m = find_merge(ids[pos], ids[nx])) {
        heap.push_back({m->rank, static_cast<std::uint32_t>(pos), m->new_id});
        std::push_heap(heap.begin(), heap.end(), heap_less);
      }
    }
  }
  for (std::int32_t i = 0; i != -1; i = next[static_cast<std::size_t>(i)])
    out.push_back(ids[static_cast<std::size_t>(i)]);
}

void BpeModel::encode_piece_uncached(std::string_view piece, std::vector<std::int32_t>& out) const {
  if (piece.empty()) return;
  if (opts_.ignore_merges) {
    if (fast_bytes_) {
      auto it = raw_vocab_.find(std::string(piece));
      if (it != raw_vocab_.end()) {
        out.push_back(it->second);
        return;
      }
    } else {
      std::string key = opts_.byte_level_input ? bytes_to_byte_level(piece) : std::string(piece);
      auto it = vocab_.find(key);
      if (it != vocab_.end()) {
        out.push_back(it->second);
        return;
      }
    }
  }
  thread_local std::vector<std::int32_t> ids;
  thread_local std::vector<std::uint32_t> lens;
  initial_symbols(piece, ids, lens);
  merge_all(ids, lens, out);
}

void BpeModel::encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
  if (piece.size() > kMaxCachedPiece) {
    encode_piece_uncached(piece, out);
    return;
  }
  PieceCache& cache = t_cache;
  if (cache.owner != serial_) {
    cache.map.clear();
    cache.owner = serial_;
  }
  auto it = cache.map.find(piece);
  if (it != cache.map.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const std::size_t start = out.size();
  encode_piece_uncached(piece, out);
  if (cache.map.size() >= kCacheCapacity) cache.map.clear();
  cache.map.emplace(std::string(piece),
                    std::vector<std::int32_t>(out.begin() + static_cast<std::ptrdiff_t>(start),
                                              out.end()));
}

}  // namespace lorasync::tok
