#include "engine/block_manager.h"

#include "util/error.h"

namespace lorasync::engine {

namespace {

// 64-bit mixers (splitmix64 finaliser); two independently seeded lanes give a 128-bit hash.
inline std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

BlockHash seed_hash(std::string_view identity) {
  BlockHash h{0x243f6a8885a308d3ull, 0x13198a2e03707344ull};
  for (unsigned char c : identity) {
    h.a = mix(h.a ^ c);
    h.b = mix(h.b + c * 0x9e3779b97f4a7c15ull);
  }
  h.a = mix(h.a ^ identity.size());
  h.b = mix(h.b ^ (identity.size() << 1));
  return h;
}

BlockHash chain_hash(const BlockHash& prev, const std::int32_t* ids, std::size_t n) {
  BlockHash h{mix(prev.a ^ 0xa4093822299f31d0ull), mix(prev.b ^ 0x082efa98ec4e6c89ull)};
  for (std::size_t i = 0; i < n; ++i) {
    auto v = static_cast<std::uint64_t>(static_cast<std::uint32_t>(ids[i]));
    h.a = mix(h.a ^ v);
    h.b = mix(h.b + (v | (static_cast<std::uint64_t>(i) << 32)));
  }
  return h;
}

BlockManager::BlockManager(std::int64_t n_blocks, std::int64_t block_size, bool enable_prefix_cache)
    : block_size_(block_size), caching_(enable_prefix_cache) {
  LS_CHECK(n_blocks > 0 && block_size > 0);
  const auto n = static_cast<std::size_t>(n_blocks);
  ref_.assign(n, 0);
  hash_of_.assign(n, std::nullopt);
  lru_pos_.resize(n);
  in_lru_.assign(n, false);
  free_.reserve(n);
  for (std::int64_t b = n_blocks - 1; b >= 0; --b) free_.push_back(static_cast<std::int32_t>(b));
}

std::optional<std::int32_t> BlockManager::allocate() {
  std::int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    b = lru_.front();
    lru_.pop_front();
    in_lru_[static_cast<std::size_t>(b)] = false;
    by_hash_.erase(*hash_of_[static_cast<std::size_t>(b)]);
    hash_of_[static_cast<std::size_t>(b)].reset();
    ++evictions_;
  } else {
    return std::nullopt;
  }
  ref_[static_cast<std::size_t>(b)] = 1;
  return b;
}

std::optional<std::int32_t> BlockManager::lookup(const BlockHash& h) {
  if (!caching_) return std::nullopt;
  auto it = by_hash_.find(h);
  if (it == by_hash_.end()) return std::nullopt;
  const auto b = static_cast<std::size_t>(it->second);
  if (in_lru_[b]) {
    lru_.erase(lru_pos_[b]);
    in_lru_[b] = false;
  }
  ++ref_[b];
  return it->second;
}

void BlockManager::register_full(std::int32_t block, const BlockHash& h) {
  if (!caching_) return;
  const auto b = static_cast<std::size_t>(block);
  if (hash_of_[b] || by_hash_.count(h)) return;
  hash_of_[b] = h;
  by_hash_.emplace(h, block);
}

void BlockManager::release(std::int32_t block) {
  const auto b = static_cast<std::size_t>(block);
  LS_CHECK(ref_[b] > 0, "block {} released with ref 0", block);
  if (--ref_[b] > 0) return;
  if (hash_of_[b]) {
    lru_.push_back(block);
    lru_pos_[b] = std::prev(lru_.end());
    in_lru_[b] = true;
  } else {
    free_.push_back(block);
  }
}

std::int64_t BlockManager::reset_cache() {
  std::int64_t n = 0;
  for (auto b : lru_) {
    const auto i = static_cast<std::size_t>(b);
    by_hash_.erase(*hash_of_[i]);
    hash_of_[i].reset();
    in_lru_[i] = false;
    free_.push_back(b);
    ++n;
  }
  lru_.clear();
  // Blocks in use keep their data but stop being shareable.
  for (std::size_t i = 0; i < hash_of_.size(); ++i)
    if (hash_of_[i] && ref_[i] > 0) {
      by_hash_.erase(*hash_of_[i]);
      hash_of_[i].reset();
    }
  return n;
}

}  // namespace lorasync::engine
