#include "engine/sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "core/model/cpu_kernels.h"
#include "core/model/qwen2_model.h"

namespace lorasync::engine {

namespace {

at::Tensor apply_penalty(at::Tensor row, const SampleRow& r) {
  const double pen = r.params->repetition_penalty;
  if (pen == 1.0 || r.history == nullptr || r.history->empty()) return row;
  std::unordered_set<std::int32_t> seen(r.history->begin(), r.history->end());
  std::vector<std::int64_t> ids(seen.begin(), seen.end());
  std::sort(ids.begin(), ids.end());
  auto idx = at::tensor(ids, at::TensorOptions().dtype(at::kLong));
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

// Inverse-CDF draw: the first token whose cumulative probability exceeds u * total, found by
// walking the block sums, then the one block.
std::int32_t draw(const float* probs, const double* sums, std::int64_t V, std::mt19937_64& rng) {
  const double u = static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
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

std::vector<TokenOut> sample_batch(const at::Tensor& logits_in, const std::vector<SampleRow>& rows) {
  auto logits = logits_in.to(at::kCPU).to(at::kFloat).contiguous();
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
      const bool truncated = p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0;
      if (fast && (p.temperature <= 0 || !truncated)) {
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
