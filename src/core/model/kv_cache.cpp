#include "core/model/kv_cache.h"

#include <ATen/ATen.h>

#include <limits>

#include "util/error.h"

namespace lorasync::model {

KvPool KvPool::allocate(const ModelConfig& cfg, std::int64_t n_slots, c10::ScalarType dtype,
                        c10::Device device) {
  KvPool p;
  auto opts = at::TensorOptions().dtype(dtype).device(device);
  for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    p.k.push_back(at::zeros({n_slots, cfg.num_key_value_heads, cfg.head_dim}, opts));
    p.v.push_back(at::zeros({n_slots, cfg.num_key_value_heads, cfg.head_dim}, opts));
  }
  return p;
}

std::int64_t KvPool::bytes_per_slot(const ModelConfig& cfg, c10::ScalarType dtype) {
  return 2 * cfg.num_hidden_layers * cfg.kv_dim() * static_cast<std::int64_t>(c10::elementSize(dtype));
}

ContiguousKvCache::ContiguousKvCache(const ModelConfig& cfg, std::int64_t n_seqs,
                                     std::int64_t capacity, c10::ScalarType dtype,
                                     c10::Device device)
    : pool_(KvPool::allocate(cfg, n_seqs * capacity, dtype, device)),
      capacity_(capacity),
      lengths_(static_cast<std::size_t>(n_seqs), 0),
      device_(device) {}

AttnMeta ContiguousKvCache::plan(const std::vector<Segment>& segs,
                                 const std::vector<std::int64_t>& seq_ids, bool batched_decode) {
  LS_CHECK(segs.size() == seq_ids.size());
  AttnMeta meta;
  std::vector<std::int64_t> slots;
  bool all_decode = batched_decode && !segs.empty();
  std::int64_t lmax = 0;
  for (std::size_t i = 0; i < segs.size(); ++i) {
    auto& len = lengths_.at(static_cast<std::size_t>(seq_ids[i]));
    const auto& s = segs[i];
    if (s.past != len)
      throw_invalid("segment {} starts at position {} but sequence {} holds {} tokens", i, s.past,
                    seq_ids[i], len);
    if (len + s.len > capacity_)
      throw_invalid("sequence {} would hold {} tokens, capacity is {}", seq_ids[i], len + s.len,
                    capacity_);
    const std::int64_t base = seq_ids[i] * capacity_;
    for (std::int64_t j = 0; j < s.len; ++j) slots.push_back(base + len + j);
    meta.context_slots.push_back(
        at::arange(base, base + len + s.len, at::TensorOptions().dtype(at::kLong)).to(device_));
    len += s.len;
    if (s.len != 1) all_decode = false;
    lmax = std::max(lmax, len);
  }
  meta.slot_mapping = at::tensor(slots, at::TensorOptions().dtype(at::kLong)).to(device_);
  if (all_decode) {
    const auto B = static_cast<std::int64_t>(segs.size());
    auto idx = at::zeros({B, lmax}, at::TensorOptions().dtype(at::kLong));
    auto bias = at::full({B, lmax}, -std::numeric_limits<float>::infinity(),
                         at::TensorOptions().dtype(at::kFloat));
    for (std::int64_t b = 0; b < B; ++b) {
      auto n = meta.context_slots[static_cast<std::size_t>(b)].size(0);
      idx[b].narrow(0, 0, n).copy_(meta.context_slots[static_cast<std::size_t>(b)].cpu());
      bias[b].narrow(0, 0, n).zero_();
    }
    std::vector<std::int64_t> lens;
    for (const auto& c : meta.context_slots) lens.push_back(c.size(0));
    meta.decode_slots = idx.to(device_);
    meta.decode_bias = bias.to(device_);
    meta.decode_lens = at::tensor(lens, at::TensorOptions().dtype(at::kLong)).to(device_);
  }
  return meta;
}

}  // namespace lorasync::model
