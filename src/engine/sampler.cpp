#include "engine/sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

namespace lorasync::engine {

namespace {

bool plain(const SamplingParams& p) {
  return p.temperature > 0 && (p.top_k <= 0) && p.top_p >= 1.0 && p.min_p <= 0 &&
         p.repetition_penalty == 1.0;
}

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

std::int32_t draw(const float* logp, std::int64_t V, std::mt19937_64& rng) {
  const double u = static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
  double total = 0;
  for (std::int64_t i = 0; i < V; ++i) total += std::exp(static_cast<double>(logp[i]));
  const double target = u * total;
  double acc = 0;
  std::int64_t last = 0;
  for (std::int64_t i = 0; i < V; ++i) {
    if (logp[i] == -std::numeric_limits<float>::infinity()) continue;
    acc += std::exp(static_cast<double>(logp[i]));
    last = i;
    if (acc > target) return static_cast<std::int32_t>(i);
  }
  return static_cast<std::int32_t>(last);
}

void add_top(TokenOut& t, const at::Tensor& logp_row, int k) {
  if (k <= 0) return;
  auto [vals, idx] = at::topk(logp_row, std::min<std::int64_t>(k, logp_row.size(0)));
  auto v = vals.contiguous();
  auto ix = idx.contiguous();
  for (std::int64_t i = 0; i < v.size(0); ++i)
    t.top.emplace_back(static_cast<std::int32_t>(ix[i].item<std::int64_t>()), v[i].item<float>());
}

}  // namespace

std::vector<TokenOut> sample_batch(const at::Tensor& logits_in, const std::vector<SampleRow>& rows) {
  auto logits = logits_in.to(at::kCPU).to(at::kFloat).contiguous();
  const auto B = logits.size(0), V = logits.size(1);
  std::vector<TokenOut> out(static_cast<std::size_t>(B));
  // Fast path: plain temperature sampling for many rows at once (row-wise, batch-independent).
  std::vector<std::int64_t> plain_rows;
  for (std::int64_t i = 0; i < B; ++i)
    if (plain(*rows[static_cast<std::size_t>(i)].params)) plain_rows.push_back(i);
  at::Tensor plain_logp;
  if (!plain_rows.empty()) {
    std::vector<double> temps;
    for (auto i : plain_rows) temps.push_back(rows[static_cast<std::size_t>(i)].params->temperature);
    auto idx = at::tensor(plain_rows, at::TensorOptions().dtype(at::kLong));
    auto t = at::tensor(temps, at::TensorOptions().dtype(at::kDouble)).to(at::kFloat).unsqueeze(1);
    plain_logp = at::log_softmax(logits.index_select(0, idx) / t, 1).contiguous();
  }
  std::size_t pi = 0;
  for (std::int64_t i = 0; i < B; ++i) {
    const SampleRow& r = rows[static_cast<std::size_t>(i)];
    const SamplingParams& p = *r.params;
    TokenOut& t = out[static_cast<std::size_t>(i)];
    at::Tensor logp;
    if (pi < plain_rows.size() && plain_rows[pi] == i) {
      logp = plain_logp[static_cast<std::int64_t>(pi++)];
      t.id = draw(logp.data_ptr<float>(), V, *r.rng);
    } else {
      auto row = apply_penalty(logits[i], r);
      if (p.temperature <= 0) {
        logp = at::log_softmax(row, 0).contiguous();
        t.id = static_cast<std::int32_t>(row.argmax().item<std::int64_t>());
      } else {
        logp = processed_logprobs(row, p).contiguous();
        t.id = draw(logp.data_ptr<float>(), V, *r.rng);
      }
    }
    t.logprob = logp.data_ptr<float>()[t.id];
    if (p.logprobs && *p.logprobs > 0) add_top(t, logp, *p.logprobs);
  }
  return out;
}

}  // namespace lorasync::engine
