// engine/block_manager.h: the paged KV cache's block pool and the prefix cache.
//
// The pool has n_blocks blocks of block_size token slots (slot = block * block_size + offset in
// the model's KvPool). Each block has a reference count (sequences using it). A full block can be
// registered under a chained hash h_i = H(h_{i-1}, its token ids) whose seed h_0 is the adapter's
// identity (name + content checksum, or the base model), so the same tokens under two adapters
// never share blocks. Registered blocks whose count drops to 0 stay cached in an LRU list and are
// reused by a later prompt with the same prefix, or evicted (oldest first) when a fresh block is
// needed.
//
// Thread-safety: none; owned by the engine thread.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace lorasync::engine {

struct BlockHash {
  std::uint64_t a = 0, b = 0;
  bool operator==(const BlockHash& o) const { return a == o.a && b == o.b; }
};
struct BlockHashHasher {
  std::size_t operator()(const BlockHash& h) const { return static_cast<std::size_t>(h.a ^ (h.b * 0x9e3779b97f4a7c15ull)); }
};

// h_0 from an identity string; h_i from h_{i-1} and the block's token ids.
BlockHash seed_hash(std::string_view identity);
BlockHash chain_hash(const BlockHash& prev, const std::int32_t* ids, std::size_t n);

class BlockManager {
 public:
  BlockManager(std::int64_t n_blocks, std::int64_t block_size, bool enable_prefix_cache);

  std::int64_t block_size() const { return block_size_; }
  std::int64_t n_blocks() const { return static_cast<std::int64_t>(ref_.size()); }
  // Blocks obtainable now: never-used/free ones plus cached ones nobody references.
  std::int64_t n_available() const { return static_cast<std::int64_t>(free_.size() + lru_.size()); }
  std::int64_t n_used() const { return n_blocks() - n_available(); }
  std::int64_t n_cached() const { return static_cast<std::int64_t>(by_hash_.size()); }

  // A fresh block (ref 1), evicting the least recently used cached block if needed.
  std::optional<std::int32_t> allocate();
  // A cached block with this hash, referenced (ref + 1); nullopt if absent or caching is off.
  std::optional<std::int32_t> lookup(const BlockHash& h);
  // Registers a full block under h (no-op if h is already known or caching is off).
  void register_full(std::int32_t block, const BlockHash& h);
  void ref(std::int32_t block) { ++ref_[static_cast<std::size_t>(block)]; }
  // Drops one reference; at 0 the block becomes cached (if registered) or free.
  void release(std::int32_t block);
  std::int32_t ref_count(std::int32_t block) const { return ref_[static_cast<std::size_t>(block)]; }
  // Forgets every cached block nobody references. Returns how many.
  std::int64_t reset_cache();
  std::int64_t evictions() const { return evictions_; }

 private:
  std::int64_t block_size_;
  bool caching_;
  std::vector<std::int32_t> ref_;
  std::vector<std::optional<BlockHash>> hash_of_;
  std::vector<std::int32_t> free_;  // stack of blocks with ref 0 and no hash
  std::list<std::int32_t> lru_;     // blocks with ref 0 and a hash, oldest first
  std::vector<std::list<std::int32_t>::iterator> lru_pos_;
  std::vector<bool> in_lru_;
  std::unordered_map<BlockHash, std::int32_t, BlockHashHasher> by_hash_;
  std::int64_t evictions_ = 0;
};

}  // namespace lorasync::engine
