#include "engine/sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "core/model/cpu_kernels.h"
#include "core/model/decoder_model.h"

namespace lorasync::engine {

namespace {

bool is_truncated(const SamplingParams& p) { return p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0; }

bool has_penalty(const SampleRow& r) {
  return r.params->repetition_penalty != 1.0 && r.history != nullptr && !r.history->empty();
}

at::Tensor apply_penalty(at::Tensor row, const SampleRow& r) {
  if (!has_penalty(r)) return row;
  const double pen = r.params->repetition_penalty;
  std::unordered_set<std::int32_t> seen(r.history->begin(), r.history->end());
  std::vector<std::int64_t> ids(seen.begin(), seen.end());
  std::sort(ids.begin(), ids.end());
  auto idx = at::tensor(ids, at::TensorOptions().dtype(at::kLong)).to(row.device());
  auto vals = row.index_select(0, idx);
  vals = at::where(vals > 0, vals / pen, vals * pen);
  row = row.clone();
  row.index_copy_(0, idx, vals);
  return row;
}

// Processed log-probabilities of one row after temperature and truncation.
at::Tensor processed_logprobs(at::Tensor x, const SamplingParams& p) {
  const float ninf = -std::numeric_limits<float>::infinity();
  x = x / p.temperature;
  const auto V = x.size(0);
  if (p.top_k > 0 && p.top_k < V) {
    auto kth = std::get<0>(at::topk(x, p.top_k)).min();
    x = x.masked_fill(x < kth, ninf);
  }
  if (p.top_p < 1.0) {
    auto [sorted, order] = at::sort(x, /*dim=*/0, /*descending=*/true);
    auto probs = at::softmax(sorted, 0);
    auto cum = at::cumsum(probs, 0);
    // Drop a token when the mass before it already reaches top_p (the first is always kept).
    auto drop = (cum - probs) >= p.top_p;
    auto masked = sorted.masked_fill(drop, ninf);
    x = at::empty_like(x).index_put_({order}, masked);
  }
  if (p.min_p > 0) {
    auto probs = at::softmax(x, 0);
    x = x.masked_fill(probs < probs.max() * p.min_p, ninf);
  }
  return at::log_softmax(x, 0);
}

constexpr std::int64_t kBlock = 1024;

// Per-row block sums of exp(logp) in double: [B, ceil(V / kBlock)]. Computed row-wise by ATen's
// vectorised kernels, so a row's sums do not depend on the other rows of the batch.
at::Tensor block_sums(const at::Tensor& probs) {
  const auto B = probs.size(0), V = probs.size(1);
  const auto nb = (V + kBlock - 1) / kBlock;
  auto padded = at::constant_pad_nd(probs, {0, nb * kBlock - V}, 0);
  return padded.view({B, nb, kBlock}).sum(-1, /*keepdim=*/false, at::kDouble).contiguous();
}

// The row's uniform in [0, 1): 53 bits of its generator.
double uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0); }

// Inverse-CDF draw: the first token whose cumulative probability exceeds u * total, found by
// walking the block sums, then the one block.
std::int32_t draw(const float* probs, const double* sums, std::int64_t V, std::mt19937_64& rng) {
  const double u = uniform(rng);
  const std::int64_t nb = (V + kBlock - 1) / kBlock;
  double total = 0;
  for (std::int64_t b = 0; b < nb; ++b) total += sums[b];
  const double target = u * total;
  double acc = 0;
  std::int64_t last = -1;
  for (std::int64_t b = 0; b < nb; ++b) {
    if (acc + sums[b] <= target && b + 1 < nb) {
      acc += sums[b];
      continue;
    }
    const std::int64_t end = std::min(V, (b + 1) * kBlock);
    for (std::int64_t i = b * kBlock; i < end; ++i) {
      if (probs[i] <= 0) continue;
      acc += static_cast<double>(probs[i]);
      last = i;
      if (acc > target) return static_cast<std::int32_t>(i);
    }
  }
  if (last < 0)  // rounding pushed the target past the last block: take the last possible token
    for (std::int64_t i = V - 1; i >= 0; --i)
      if (probs[i] > 0) return static_cast<std::int32_t>(i);
  return static_cast<std::int32_t>(std::max<std::int64_t>(last, 0));
}

void add_top(TokenOut& t, const at::Tensor& logp_row, int k) {
  if (k <= 0) return;
  auto [vals, idx] = at::topk(logp_row, std::min<std::int64_t>(k, logp_row.size(0)));
  auto v = vals.contiguous();
  auto ix = idx.contiguous();
  for (std::int64_t i = 0; i < v.size(0); ++i)
    t.top.emplace_back(static_cast<std::int32_t>(ix[i].item<std::int64_t>()), v[i].item<float>());
}

// The k largest of x (ties: the lower id first), best first, without sorting the row.
std::vector<std::pair<std::int32_t, float>> top_of(const float* x, std::int64_t V, int k) {
  const auto kk = static_cast<std::size_t>(std::min<std::int64_t>(k, V));
  auto worse = [](const std::pair<std::int32_t, float>& a, const std::pair<std::int32_t, float>& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  };
  std::vector<std::pair<std::int32_t, float>> heap;  // min-heap under `worse`: front = worst kept
  heap.reserve(kk + 1);
  for (std::int64_t i = 0; i < V; ++i) {
    std::pair<std::int32_t, float> c{static_cast<std::int32_t>(i), x[i]};
    if (heap.size() < kk) {
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), worse);
    } else if (worse(c, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      heap.back() = c;
      std::push_heap(heap.begin(), heap.end(), worse);
    }
  }
  std::sort(heap.begin(), heap.end(), worse);
  return heap;
}

// Plain temperature sampling and greedy decoding of one row straight from the logits: the
// softmax statistics in two vectorised passes (max; exp with block sums), no log-softmax tensor.
// The drawn token's logprob is z - max - log(sum exp(z - max)) for z = x / T (T = 1 for greedy).
void sample_fast(const float* x, std::int64_t V, const SampleRow& r, TokenOut& t,
                 std::vector<float>& e, std::vector<double>& sums) {
  const SamplingParams& p = *r.params;
  const bool greedy = p.temperature <= 0;
  const float temp = greedy ? 1.0f : static_cast<float>(p.temperature);
  const float mx = model::cpu::row_max(x, V, temp);
  sums.resize(static_cast<std::size_t>((V + kBlock - 1) / kBlock));
  if (greedy) {
    std::int64_t best = 0;
    for (std::int64_t i = 1; i < V; ++i)
      if (x[i] > x[best]) best = i;
    t.id = static_cast<std::int32_t>(best);
  } else {
    e.resize(static_cast<std::size_t>(V));
  }
  const double total =
      model::cpu::row_exp_blocks(x, V, temp, mx, greedy ? nullptr : e.data(), sums.data(), kBlock);
  const double log_total = std::log(total);
  if (!greedy) t.id = draw(e.data(), sums.data(), V, *r.rng);
  auto logp = [&](std::int64_t i) {
    return static_cast<float>(static_cast<double>(x[i] / temp) - mx - log_total);
  };
  t.logprob = logp(t.id);
  if (p.logprobs && *p.logprobs > 0)
    for (const auto& [id, v] : top_of(x, V, *p.logprobs)) t.top.emplace_back(id, logp(id));
}

}  // namespace

std::vector<TokenOut> sample_batch_tensor_ops(const at::Tensor& logits_in, const std::vector<SampleRow>& rows) {
  auto logits = logits_in.to(at::kFloat);
  const auto B = logits.size(0), V = logits.size(1);
  const auto dev = logits.device();
  std::vector<TokenOut> out(static_cast<std::size_t>(B));
  if (B == 0) return out;
  // Per row: its temperature (1 for greedy) and its uniform, taken from its generator exactly when
  // the host path takes one (sampled rows only), so a seeded request draws the same.
  std::vector<float> temps(static_cast<std::size_t>(B));
  std::vector<double> us(static_cast<std::size_t>(B), 0.0);
  std::vector<std::uint8_t> greedy(static_cast<std::size_t>(B));
  int top_k = 0;
  for (std::int64_t i = 0; i < B; ++i) {
    const SampleRow& r = rows[static_cast<std::size_t>(i)];
    const SamplingParams& p = *r.params;
    greedy[static_cast<std::size_t>(i)] = p.temperature <= 0;
    temps[static_cast<std::size_t>(i)] = p.temperature <= 0 ? 1.0f : static_cast<float>(p.temperature);
    if (p.temperature > 0) us[static_cast<std::size_t>(i)] = uniform(*r.rng);
    if (p.logprobs) top_k = std::max(top_k, *p.logprobs);
  }
  // Processed logprobs [B, V]: one batched log-softmax of x / T, then the rows with a penalty or a
  // truncation recomputed by the row expression.
  auto t = at::tensor(temps, at::TensorOptions().dtype(at::kFloat)).to(dev).unsqueeze(1);
  auto logp = at::log_softmax(logits / t, 1);
  for (std::int64_t i = 0; i < B; ++i) {
    const SampleRow& r = rows[static_cast<std::size_t>(i)];
    const SamplingParams& p = *r.params;
    if (!has_penalty(r) && !(p.temperature > 0 && is_truncated(p))) continue;
    auto row = apply_penalty(logits[i], r);
    logp[i].copy_(p.temperature <= 0 ? at::log_softmax(row, 0) : processed_logprobs(row, p));
  }
  // Greedy: the arg max (log-softmax keeps the order). Sampled: the inverse-CDF draw over block sums
  // in double, as on the host: the block whose running sum first exceeds u * total, then the
  // position in it.
  auto ids = logp.argmax(1);
  auto probs = logp.exp();
  const std::int64_t nb = (V + kBlock - 1) / kBlock;
  auto padded = at::constant_pad_nd(probs, {0, nb * kBlock - V}, 0).view({B, nb, kBlock});
  auto csum = padded.sum(-1, /*keepdim=*/false, at::kDouble).cumsum(1);  // [B, nb]
  auto u = at::tensor(us, at::TensorOptions().dtype(at::kDouble)).to(dev);
  auto target = (u * csum.select(1, nb - 1)).unsqueeze(1);  // [B, 1]
  auto blk = at::searchsorted(csum, target, /*out_int32=*/false, /*right=*/true).clamp_max(nb - 1);  // [B, 1]
  auto before = at::where(blk > 0, csum.gather(1, (blk - 1).clamp_min(0)), at::zeros_like(target));
  auto within = padded.gather(1, blk.unsqueeze(2).expand({B, 1, kBlock})).squeeze(1).to(at::kDouble).cumsum(1) + before;
  auto pos = at::searchsorted(within, target, /*out_int32=*/false, /*right=*/true);  // [B, 1]
  auto drawn = (blk * kBlock + pos).squeeze(1);
  // Rounding pushed the target past the row's mass: its last possible token, as on the host.
  auto last = (V - 1) - (probs.flip(1) > 0).to(at::kByte).argmax(1);
  drawn = at::where((pos.squeeze(1) >= kBlock) | (drawn >= V), last, drawn);
  auto g = at::tensor(greedy, at::TensorOptions().dtype(at::kByte)).to(at::kBool).to(dev);
  ids = at::where(g, ids, drawn);
  auto lp = logp.gather(1, ids.unsqueeze(1)).squeeze(1);
  // Only these come back to the host: ids, their logprobs, and the top logprobs asked for.
  auto ids_h = ids.to(at::kCPU).contiguous();
  auto lp_h = lp.to(at::kCPU).contiguous();
  at::Tensor top_v, top_i;
  if (top_k > 0) {
    auto [v, ix] = at::topk(logp, std::min<std::int64_t>(top_k, V), 1);
    top_v = v.to(at::kCPU).contiguous();
    top_i = ix.to(at::kCPU).contiguous();
  }
  for (std::int64_t i = 0; i < B; ++i) {
    TokenOut& o = out[static_cast<std::size_t>(i)];
    o.id = static_cast<std::int32_t>(ids_h.data_ptr<std::int64_t>()[i]);
    o.logprob = lp_h.data_ptr<float>()[i];
    const auto& lk = rows[static_cast<std::size_t>(i)].params->logprobs;
    if (lk && *lk > 0)
      for (std::int64_t k = 0; k < std::min<std::int64_t>(*lk, V); ++k)
        o.top.emplace_back(static_cast<std::int32_t>(top_i.data_ptr<std::int64_t>()[i * top_i.size(1) + k]),
                           top_v.data_ptr<float>()[i * top_v.size(1) + k]);
  }
  return out;
}

std::vector<TokenOut> sample_batch(const at::Tensor& logits_in, const std::vector<SampleRow>& rows) {
  // Logits on a GPU are sampled where they are: no copy of [B, V] to the host.
  if (!logits_in.device().is_cpu()) return sample_batch_tensor_ops(logits_in, rows);
  auto logits = logits_in.to(at::kFloat).contiguous();
  const auto B = logits.size(0), V = logits.size(1);
  std::vector<TokenOut> out(static_cast<std::size_t>(B));
  const bool fast = model::cpu_fast_paths();
  // Rows are independent (each draws from its own generator), so they run on the intra-op
  // threads and a row's result does not depend on the batch or the thread count.
  model::cpu::parallel_for(B, [&](std::int64_t b0, std::int64_t b1) {
    std::vector<float> e;
    std::vector<double> sums;
    for (std::int64_t i = b0; i < b1; ++i) {
      const SampleRow& r = rows[static_cast<std::size_t>(i)];
      const SamplingParams& p = *r.params;
      TokenOut& t = out[static_cast<std::size_t>(i)];
      auto row = apply_penalty(logits[i], r).contiguous();
      if (fast && (p.temperature <= 0 || !is_truncated(p))) {
        sample_fast(row.data_ptr<float>(), V, r, t, e, sums);
        continue;
      }
      // The libtorch expression (truncation; every row with the fast paths off).
      at::Tensor logp;
      if (p.temperature <= 0) {
        logp = at::log_softmax(row, 0).contiguous();
        t.id = static_cast<std::int32_t>(row.argmax().item<std::int64_t>());
      } else {
        logp = processed_logprobs(row, p).contiguous();
        auto probs = logp.exp().unsqueeze(0).contiguous();
        auto bs = block_sums(probs);
        t.id = draw(probs.data_ptr<float>(), bs.data_ptr<double>(), V, *r.rng);
      }
      t.logprob = logp.data_ptr<float>()[t.id];
      if (p.logprobs && *p.logprobs > 0) add_top(t, logp, *p.logprobs);
    }
  });
  return out;
}

}  // namespace lorasync::engine
