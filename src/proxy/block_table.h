// proxy/block_table.h: the ownership table of the router (proxy.md §3.3, §5).
//
// Maps a 128-bit block hash to {owners bitmask, successor fingerprint, branched flag}. Layout:
// a slab of 48-byte entries, an open-addressing index of 32-bit slot numbers (linear probing,
// backward-shift deletion, no tombstones) and an intrusive doubly linked LRU list threaded
// through the slab. Memory: 48 B per entry + 4 B / load factor per index slot, about 56 B per
// tracked block at the default bound (500k entries -> 1M index slots).
//
// The table may exceed its bound while one request is recorded; the router evicts right after.
// Thread-safety: none; the router serialises all access under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "proxy/hash128.h"

namespace lorasync::proxy {

class BlockTable {
 public:
  static constexpr std::uint32_t kNil = 0xFFFFFFFFu;

  struct Entry {
    Hash128 key;                  // 16 B
    std::uint64_t owners = 0;     // bit r: replica r holds this block (as far as we know)
    std::uint64_t successor = 0;  // fingerprint of the first next-block hash seen
    std::uint32_t prev = kNil;    // LRU links (towards least recent / most recent)
    std::uint32_t next = kNil;
    std::uint32_t flags = 0;      // kUsed | kHasSuccessor | kBranched
    std::uint32_t pad = 0;
  };
  static_assert(sizeof(Entry) == 48);
  static constexpr std::uint32_t kUsed = 1, kHasSuccessor = 2, kBranched = 4;

  // Preallocates for `bound` entries.
  explicit BlockTable(std::size_t bound);

  std::size_t size() const { return size_; }
  std::size_t bound() const { return bound_; }

  // Slot of `key` or kNil.
  std::uint32_t find(const Hash128& key) const;
  // Slot of `key`, created (no owners, most recent) if absent.
  std::uint32_t find_or_insert(const Hash128& key);
  Entry& at(std::uint32_t slot) { return slab_[slot]; }
  const Entry& at(std::uint32_t slot) const { return slab_[slot]; }

  // Successor rule: first next-block fingerprint is remembered; a different one sets branched.
  void feed_successor(std::uint32_t slot, std::uint64_t fingerprint);
  void touch(std::uint32_t slot);  // move to the most-recent end

  // Evicts least-recent entries until size <= bound; returns how many.
  std::size_t evict_to_bound();
  // Clears bit `replica` everywhere; removes ownerless entries. Returns entries removed.
  std::size_t purge_replica(int replica);
  void clear();

  // Least-recent first (tests and the oracle comparison).
  std::vector<Hash128> lru_order() const;
  // Bytes held by the slab and the index (the memory-per-block figure).
  std::size_t memory_bytes() const;

 private:
  std::size_t home(const Hash128& k) const { return static_cast<std::size_t>(k.lo) & mask_; }
  void unlink(std::uint32_t slot);
  void link_back(std::uint32_t slot);
  void erase(std::uint32_t slot);
  void index_erase(std::size_t pos);
  void grow_index();

  std::size_t bound_;
  std::size_t size_ = 0;
  std::vector<Entry> slab_;
  std::vector<std::uint32_t> free_;   // free slab slots
  std::vector<std::uint32_t> index_;  // slot + 1, 0 = empty
  std::size_t mask_ = 0;
  std::uint32_t head_ = kNil;  // least recent
  std::uint32_t tail_ = kNil;  // most recent
};

}  // namespace lorasync::proxy
