#include "proxy/block_table.h"

#include "util/error.h"

namespace lorasync::proxy {

namespace {
std::size_t index_capacity(std::size_t entries) {
  std::size_t cap = 16;
  while (cap * 7 < entries * 10) cap <<= 1;  // load factor <= 0.7
  return cap;
}
}  // namespace

BlockTable::BlockTable(std::size_t bound) : bound_(bound) {
  LS_CHECK(bound >= 1 && bound < 0x7FFFFFFFu, "bad table bound {}", bound);
  slab_.reserve(bound + 1024);
  index_.assign(index_capacity(bound), 0);
  mask_ = index_.size() - 1;
}

std::uint32_t BlockTable::find(const Hash128& key) const {
  for (std::size_t pos = home(key);; pos = (pos + 1) & mask_) {
    std::uint32_t v = index_[pos];
    if (v == 0) return kNil;
    if (slab_[v - 1].key == key) return v - 1;
  }
}

std::uint32_t BlockTable::find_or_insert(const Hash128& key) {
  std::size_t pos = home(key);
  for (;; pos = (pos + 1) & mask_) {
    std::uint32_t v = index_[pos];
    if (v == 0) break;
    if (slab_[v - 1].key == key) return v - 1;
  }
  std::uint32_t slot;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    slot = static_cast<std::uint32_t>(slab_.size());
    slab_.emplace_back();
  }
  Entry& e = slab_[slot];
  e = Entry{};
  e.key = key;
  e.flags = kUsed;
  index_[pos] = slot + 1;
  ++size_;
  link_back(slot);
  if (size_ * 10 > index_.size() * 8) grow_index();
  return slot;
}

void BlockTable::grow_index() {
  std::vector<std::uint32_t> old = std::move(index_);
  index_.assign(old.size() * 2, 0);
  mask_ = index_.size() - 1;
  for (std::uint32_t v : old) {
    if (v == 0) continue;
    std::size_t pos = home(slab_[v - 1].key);
    while (index_[pos] != 0) pos = (pos + 1) & mask_;
    index_[pos] = v;
  }
}

void BlockTable::feed_successor(std::uint32_t slot, std::uint64_t fp) {
  Entry& e = slab_[slot];
  if (!(e.flags & kHasSuccessor)) {
    e.successor = fp;
    e.flags |= kHasSuccessor;
  } else if (e.successor != fp) {
    e.flags |= kBranched;
  }
}

void BlockTable::unlink(std::uint32_t s) {
  Entry& e = slab_[s];
  if (e.prev != kNil) slab_[e.prev].next = e.next; else head_ = e.next;
  if (e.next != kNil) slab_[e.next].prev = e.prev; else tail_ = e.prev;
  e.prev = e.next = kNil;
}

void BlockTable::link_back(std::uint32_t s) {
  Entry& e = slab_[s];
  e.prev = tail_;
  e.next = kNil;
  if (tail_ != kNil) slab_[tail_].next = s; else head_ = s;
  tail_ = s;
}

void BlockTable::touch(std::uint32_t s) {
  if (tail_ == s) return;
  unlink(s);
  link_back(s);
}

void BlockTable::index_erase(std::size_t pos) {
  // Backward-shift deletion: pull later members of the cluster into the hole when their home
  // position does not lie cyclically in (hole, their position].
  std::size_t hole = pos;
  std::size_t j = pos;
  while (true) {
    j = (j + 1) & mask_;
    std::uint32_t v = index_[j];
    if (v == 0) break;
    std::size_t h = home(slab_[v - 1].key);
    bool stays = (hole <= j) ? (hole < h && h <= j) : (hole < h || h <= j);
    if (!stays) {
      index_[hole] = v;
      hole = j;
    }
  }
  index_[hole] = 0;
}

void BlockTable::erase(std::uint32_t s) {
  std::size_t pos = home(slab_[s].key);
  while (index_[pos] != s + 1) pos = (pos + 1) & mask_;
  index_erase(pos);
  unlink(s);
  slab_[s].flags = 0;
  free_.push_back(s);
  --size_;
}

std::size_t BlockTable::evict_to_bound() {
  std::size_t n = 0;
  while (size_ > bound_) {
    erase(head_);
    ++n;
  }
  return n;
}

std::size_t BlockTable::purge_replica(int replica) {
  const std::uint64_t bit = std::uint64_t{1} << replica;
  std::size_t removed = 0;
  for (std::uint32_t s = 0; s < slab_.size(); ++s) {
    Entry& e = slab_[s];
    if (!(e.flags & kUsed) || !(e.owners & bit)) continue;
    e.owners &= ~bit;
    if (e.owners == 0) {
      erase(s);
      ++removed;
    }
  }
  return removed;
}

void BlockTable::clear() {
  slab_.clear();
  free_.clear();
  std::fill(index_.begin(), index_.end(), 0);
  size_ = 0;
  head_ = tail_ = kNil;
}

std::vector<Hash128> BlockTable::lru_order() const {
  std::vector<Hash128> out;
  for (std::uint32_t s = head_; s != kNil; s = slab_[s].next) out.push_back(slab_[s].key);
  return out;
}

std::size_t BlockTable::memory_bytes() const {
  return slab_.capacity() * sizeof(Entry) + index_.capacity() * sizeof(std::uint32_t) +
         free_.capacity() * sizeof(std::uint32_t);
}

}  // namespace lorasync::proxy
