// The sampler's vectorised rows (greedy, untruncated temperature) against its libtorch expression
// (model::set_cpu_fast_paths(false)): the same tokens for the same generators, the same logprobs
// and top logprobs, and rows that do not depend on their batch.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "core/model/decoder_model.h"
#include "engine/sampler.h"

namespace lorasync::engine {
namespace {

std::vector<TokenOut> sample(const at::Tensor& logits, const std::vector<SamplingParams>& params,
                             std::uint64_t seed, bool fast) {
  const bool prev = model::set_cpu_fast_paths(fast);
  std::vector<std::mt19937_64> rngs;
  for (std::size_t i = 0; i < params.size(); ++i) rngs.emplace_back(seed + i);
  std::vector<SampleRow> rows;
  for (std::size_t i = 0; i < params.size(); ++i) rows.push_back({&params[i], &rngs[i], nullptr});
  auto out = sample_batch(logits, rows);
  model::set_cpu_fast_paths(prev);
  return out;
}

// The same ids, logprobs within 1e-4, the same top logprobs (equal where truncated away).
void expect_same_tokens(const std::vector<TokenOut>& got, const std::vector<TokenOut>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].id, want[i].id) << "row " << i;
    EXPECT_NEAR(got[i].logprob, want[i].logprob, 1e-4) << "row " << i;
    ASSERT_EQ(got[i].top.size(), want[i].top.size()) << "row " << i;
    for (std::size_t k = 0; k < got[i].top.size(); ++k) {
      EXPECT_EQ(got[i].top[k].first, want[i].top[k].first) << "row " << i << " top " << k;
      if (std::isinf(want[i].top[k].second))  // truncated away (top-p rows)
        EXPECT_EQ(got[i].top[k].second, want[i].top[k].second) << "row " << i << " top " << k;
      else
        EXPECT_NEAR(got[i].top[k].second, want[i].top[k].second, 1e-4) << "row " << i << " top " << k;
    }
  }
}

TEST(Sampler, FastRowsEqualTheLibtorchExpression) {
  at::manual_seed(1);
  const std::int64_t B = 48, V = 5003;
  auto logits = at::randn({B, V}) * 4.0;
  std::vector<SamplingParams> params(static_cast<std::size_t>(B));
  for (std::int64_t i = 0; i < B; ++i) {
    auto& p = params[static_cast<std::size_t>(i)];
    p.temperature = i % 4 == 0 ? 0.0 : (i % 4 == 1 ? 1.0 : 0.6);
    p.logprobs = i % 3 == 0 ? 5 : 0;
    if (i % 8 == 7) p.top_p = 0.9;  // truncated: the libtorch path on both sides
  }
  expect_same_tokens(sample(logits, params, 100, true), sample(logits, params, 100, false));
  // The draws follow the distribution: with a peaked row, the likely token dominates.
  auto peaked = at::zeros({1, V});
  peaked[0][42] = 8.0;
  std::vector<SamplingParams> one(1);
  int hits = 0;
  for (std::uint64_t s = 0; s < 200; ++s) hits += sample(peaked, one, s, true)[0].id == 42;
  const double p42 = std::exp(8.0) / (std::exp(8.0) + static_cast<double>(V - 1));
  EXPECT_NEAR(hits / 200.0, p42, 0.12);
}

// The tensor-op sampler (the one logits on a GPU take) run on CPU tensors against the host path:
// greedy, plain and truncated temperature rows, a repetition penalty, top logprobs; the same tokens
// for the same generators, and draws that follow the distribution.
TEST(Sampler, TensorOpsEqualTheHostPath) {
  at::manual_seed(3);
  const std::int64_t B = 60, V = 5003;
  auto logits = at::randn({B, V}) * 4.0;
  std::vector<SamplingParams> params(static_cast<std::size_t>(B));
  std::vector<std::int32_t> history = {3, 17, 17, 256, 4999};
  for (std::int64_t i = 0; i < B; ++i) {
    auto& p = params[static_cast<std::size_t>(i)];
    p.temperature = i % 4 == 0 ? 0.0 : (i % 4 == 1 ? 1.0 : 0.6);
    p.logprobs = i % 3 == 0 ? 5 : 0;
    if (i % 10 == 3) p.top_p = 0.9;
    if (i % 10 == 5) p.top_k = 50;
    if (i % 10 == 7) p.min_p = 0.05;
    if (i % 6 == 1) p.repetition_penalty = 1.3;
  }
  auto run = [&](bool tensor_ops, std::uint64_t seed) {
    std::vector<std::mt19937_64> rngs;
    for (std::int64_t i = 0; i < B; ++i) rngs.emplace_back(seed + static_cast<std::uint64_t>(i));
    std::vector<SampleRow> rows;
    for (std::int64_t i = 0; i < B; ++i)
      rows.push_back({&params[static_cast<std::size_t>(i)], &rngs[static_cast<std::size_t>(i)], &history});
    return tensor_ops ? sample_batch_tensor_ops(logits, rows) : sample_batch(logits, rows);
  };
  for (std::uint64_t seed : {100u, 200u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    expect_same_tokens(run(true, seed), run(false, seed));
  }
  auto peaked = at::zeros({1, V});
  peaked[0][42] = 8.0;
  std::vector<SamplingParams> one(1);
  int hits = 0;
  for (std::uint64_t s = 0; s < 200; ++s) {
    std::mt19937_64 g(s);
    std::vector<SampleRow> r = {{&one[0], &g, nullptr}};
    hits += sample_batch_tensor_ops(peaked, r)[0].id == 42;
  }
  const double p42 = std::exp(8.0) / (std::exp(8.0) + static_cast<double>(V - 1));
  EXPECT_NEAR(hits / 200.0, p42, 0.12);
}

TEST(Sampler, ARowDoesNotDependOnItsBatch) {
  at::manual_seed(2);
  auto logits = at::randn({9, 2000}) * 3.0;
  std::vector<SamplingParams> params(9);
  auto all = sample(logits, params, 7, true);
  for (std::int64_t i = 0; i < 9; ++i) {
    std::vector<SamplingParams> one(1);
    std::mt19937_64 rng(7 + static_cast<std::uint64_t>(i));
    std::vector<SampleRow> rows = {{&one[0], &rng, nullptr}};
    auto alone = sample_batch(logits.narrow(0, i, 1), rows);
    EXPECT_EQ(alone[0].id, all[static_cast<std::size_t>(i)].id);
    EXPECT_EQ(alone[0].logprob, all[static_cast<std::size_t>(i)].logprob);
  }
}

}  // namespace
}  // namespace lorasync::engine
