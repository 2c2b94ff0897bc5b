// The trainer's memory-linear pieces (autograd_ops.h): the LM head's chunked logprobs with their
// own backward, per-layer activation checkpointing, and peak memory that grows linearly with the
// packed row (measured by counting libtorch's CPU allocations, not by timing).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <random>

#include "core/model/autograd_ops.h"
#include "core/model/logprobs.h"
#include "core/model/perf.h"
#include "core/model/decoder_model.h"
#include "core/model/runtime.h"

namespace lorasync::model {
namespace {

at::TensorOptions f64() { return at::TensorOptions().dtype(at::kDouble); }

TEST(LmHeadLogprobs, ValuesEntropyAndGradientEqualAutogradThroughLogSoftmax) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const std::int64_t N = 13, d = 8, V = 50;
  auto W = at::randn({V, d}, gen, f64());
  auto h0 = at::randn({N, d}, gen, f64());
  auto targets = at::randint(0, V, {N}, gen, at::TensorOptions().dtype(at::kLong));
  auto weights = at::randn({N}, gen, f64());  // d loss / d logprob per row
  const double T = 0.7;

  auto h_ref = h0.clone().requires_grad_(true);
  auto logp = at::log_softmax(at::linear(h_ref, W) / T, -1);
  auto lp_ref = logp.gather(1, targets.unsqueeze(1)).squeeze(1);
  auto ent_ref = -(logp.exp() * logp).sum(-1);
  (lp_ref * weights).sum().backward();

  for (std::int64_t chunk : {1, 4, 13, 64}) {
    SCOPED_TRACE(chunk);
    auto h = h0.clone().requires_grad_(true);
    const TensorFn head = [&](const at::Tensor& x) { return at::linear(x, W); };
    auto out = lm_head_logprobs(head, W, h, targets, T, chunk, /*with_entropy=*/true);
    EXPECT_TRUE(out.logprobs.requires_grad());
    EXPECT_FALSE(out.entropy.requires_grad());
    EXPECT_TRUE(at::allclose(out.logprobs, lp_ref.detach(), 0, 1e-12));
    EXPECT_TRUE(at::allclose(out.entropy, ent_ref.detach(), 0, 1e-12));
    (out.logprobs * weights).sum().backward();
    EXPECT_TRUE(at::allclose(h.grad(), h_ref.grad(), 0, 1e-12)) << (h.grad() - h_ref.grad()).abs().max();

    at::NoGradGuard ng;  // the no-gradient path gives the same numbers and keeps no Jacobian
    auto plain = lm_head_logprobs(head, W, h0, targets, T, chunk, /*with_entropy=*/false);
    EXPECT_TRUE(at::allclose(plain.logprobs, lp_ref.detach(), 0, 1e-12));
    EXPECT_FALSE(plain.entropy.defined());
  }
}

TEST(LmHeadLogprobs, TrainedHeadWeightGetsItsGradientToo) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
  auto W0 = at::randn({40, 6}, gen, f64());
  auto h0 = at::randn({9, 6}, gen, f64());
  auto targets = at::randint(0, 40, {9}, gen, at::TensorOptions().dtype(at::kLong));
  auto W_ref = W0.clone().requires_grad_(true), h_ref = h0.clone().requires_grad_(true);
  at::log_softmax(at::linear(h_ref, W_ref) / 1.3, -1).gather(1, targets.unsqueeze(1)).sum().backward();
  auto W = W0.clone().requires_grad_(true), h = h0.clone().requires_grad_(true);
  const TensorFn head = [&](const at::Tensor& x) { return at::linear(x, W); };
  lm_head_logprobs(head, W, h, targets, 1.3, 4, false).logprobs.sum().backward();
  ASSERT_TRUE(W.grad().defined());  // full fine-tuning (the demo's SFT) trains the head
  EXPECT_TRUE(at::allclose(W.grad(), W_ref.grad(), 0, 1e-12));
  EXPECT_TRUE(at::allclose(h.grad(), h_ref.grad(), 0, 1e-12));
}

TEST(LmHeadLogprobs, Bf16GradientOfConfidentTokensIsNotRoundingNoise) {
  // Tokens the model is sure of (p ~ 0.99), as most sampled RL tokens are: the gradient
  // (onehot - p) W is small, and forming it as W[t] - bf16(p W) would cancel to noise.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  const std::int64_t N = 8, d = 64, V = 512;
  auto W = at::randn({V, d}, gen, f64()).to(at::kBFloat16);
  auto targets = at::randint(0, V, {N}, gen, at::TensorOptions().dtype(at::kLong));
  auto h = (W.index_select(0, targets).to(at::kDouble) * 0.3).to(at::kBFloat16).requires_grad_(true);
  const TensorFn head = [&](const at::Tensor& x) { return at::linear(x, W).to(at::kFloat); };
  auto out = lm_head_logprobs(head, W, h, targets, 1.0, 4, false);
  out.logprobs.sum().backward();
  // Reference in fp64 from the same bf16 numbers.
  auto W64 = W.to(at::kDouble), h64 = h.detach().to(at::kDouble);
  auto p = at::softmax(at::linear(h64, W64), -1);
  EXPECT_GT(p.gather(1, targets.unsqueeze(1)).min().item<double>(), 0.9);
  auto want = (at::one_hot(targets, V).to(at::kDouble) - p).matmul(W64);
  auto got = h.grad().to(at::kDouble);
  const double rel = (got - want).abs().max().item<double>() / want.abs().max().item<double>();
  EXPECT_LT(rel, 0.08) << "relative error of the bf16 gradient";  // the naive W[t] - bf16(p W) gave ~0.15 on this construction
}

ModelConfig small_cfg() {
  auto c = ModelConfig::preset("tiny");
  c.vocab_size = 256;
  return c;
}

LoraAdapter trained_like(const ModelConfig& c, c10::ScalarType dt) {
  LoraConfig lc;
  lc.rank = 2;
  lc.alpha = 4;
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  auto a = LoraAdapter::init(lc, c, 5, at::kCPU);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  for (std::int64_t l = 0; l < a.n_layers(); ++l)
    for (auto m : lc.targets) {
      a.B(l, m).normal_(0, 0.2, gen);  // B = 0 would leave A without gradient
      a.A(l, m) = a.A(l, m).to(dt);
      a.B(l, m) = a.B(l, m).to(dt);
    }
  a.set_requires_grad(true);
  return a;
}

std::vector<LogprobItem> row_of(std::mt19937& rng, const std::vector<std::pair<int, int>>& shapes, std::int64_t vocab) {
  std::vector<LogprobItem> items;
  for (auto [p, t] : shapes) {
    LogprobItem it;
    for (int i = 0; i < p; ++i) it.prompt.push_back(static_cast<std::int64_t>(rng() % vocab));
    for (int i = 0; i < t; ++i) it.completion.push_back(static_cast<std::int64_t>(rng() % vocab));
    items.push_back(std::move(it));
  }
  return items;
}

TEST(Checkpointing, SameLogprobsAndLoraGradientsAsKeepingActivations) {
  auto c = small_cfg();
  auto m = DecoderModel::from_named(c, random_weights(c, 2, at::kFloat, 0.1), at::kDouble, at::kCPU);
  auto a = trained_like(c, at::kDouble);
  std::mt19937 rng(3);
  auto items = row_of(rng, {{5, 7}, {3, 4}, {9, 2}}, c.vocab_size);
  auto run = [&](bool ckpt) {
    for (auto& p : a.parameters()) p.mutable_grad() = at::Tensor();
    auto out = packed_logprobs(*m, &a, items, 0.9, /*chunk=*/5, /*with_entropy=*/true, ckpt);
    auto w = at::linspace(-1, 1, out.logprobs.size(0), f64());
    (out.logprobs * w).sum().backward();
    std::vector<at::Tensor> grads;
    for (auto& p : a.parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(out.logprobs.detach(), grads);
  };
  auto [lp_keep, g_keep] = run(false);
  auto [lp_ckpt, g_ckpt] = run(true);
  EXPECT_TRUE(at::allclose(lp_keep, lp_ckpt, 0, 1e-12));
  ASSERT_EQ(g_keep.size(), g_ckpt.size());
  for (std::size_t i = 0; i < g_keep.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_GT(g_keep[i].abs().max().item<double>(), 0);  // every factor gets a gradient
    EXPECT_TRUE(at::allclose(g_keep[i], g_ckpt[i], 1e-10, 1e-12)) << (g_keep[i] - g_ckpt[i]).abs().max();
  }
}

TEST(Checkpointing, RefusedWithAKvCacheAndInertWithoutGradients) {
  auto c = small_cfg();
  auto m = DecoderModel::from_named(c, random_weights(c, 2, at::kFloat, 0.1), at::kFloat, at::kCPU);
  auto a = trained_like(c, at::kFloat);
  std::mt19937 rng(4);
  auto items = row_of(rng, {{4, 6}}, c.vocab_size);
  at::NoGradGuard ng;
  auto plain = packed_logprobs(*m, &a, items, 1.0, 8, false, false);
  auto ckpt = packed_logprobs(*m, &a, items, 1.0, 8, false, true);
  EXPECT_TRUE(at::equal(plain.logprobs, ckpt.logprobs));
  ContiguousKvCache cache(c, 1, 16, at::kFloat, at::kCPU);
  auto batch = make_batch({{1, 2, 3}}, {0}, at::kCPU);
  auto meta = cache.plan(batch.segs, {0});
  EXPECT_ANY_THROW(m->forward(batch, nullptr, &cache.pool(), &meta, /*checkpoint_layers=*/true));
}

// Peak bytes of CPU tensors over one forward + backward of a row holding one sample of L tokens
// (half prompt, half completion: a single causal segment, the worst case for attention).
std::int64_t peak_bytes_for_row(const DecoderModel& m, LoraAdapter& a, std::int64_t L, bool ckpt) {
  std::mt19937 rng(static_cast<unsigned>(L));
  auto items = row_of(rng, {{static_cast<int>(L / 2), static_cast<int>(L / 2)}}, m.config().vocab_size);
  for (auto& p : a.parameters()) p.mutable_grad() = at::Tensor();
  CpuTensorMeter meter;
  {
    auto out = packed_logprobs(m, &a, items, 1.0, /*chunk=*/128, /*with_entropy=*/true, ckpt);
    out.logprobs.sum().backward();
  }
  return meter.peak_bytes();
}

TEST(TrainingMemory, PeakGrowsLinearlyWithTheRowLength) {
  auto c = small_cfg();
  c.vocab_size = 4096;  // the LM head's share of a row matters, as with a real vocabulary
  auto m = DecoderModel::from_named(c, random_weights(c, 7, at::kFloat, 0.05), at::kFloat, at::kCPU);
  auto a = trained_like(c, at::kFloat);
  for (bool ckpt : {false, true}) {
    SCOPED_TRACE(ckpt ? "checkpointed layers" : "kept activations");
    // A warm-up row first: buffers kept across calls (the LM head's reused output) are then
    // allocated before any measured row, not inside the first one only.
    (void)peak_bytes_for_row(*m, a, 256, ckpt);
    const auto p1 = peak_bytes_for_row(*m, a, 1024, ckpt);
    const auto p2 = peak_bytes_for_row(*m, a, 2048, ckpt);
    const auto p4 = peak_bytes_for_row(*m, a, 4096, ckpt);
    const double first = static_cast<double>(p2 - p1) / 1024, second = static_cast<double>(p4 - p2) / 2048;
    // Bytes per extra token of the two increments: equal within 20% (an [L, L] score tensor
    // per layer would double the second one).
    EXPECT_GT(first, 0);
    EXPECT_NEAR(second / first, 1.0, 0.2) << "peaks " << p1 << " " << p2 << " " << p4 << " bytes";
  }
}

TEST(TrainingMemory, CheckpointingKeepsLessThanKeepingActivations) {
  auto c = small_cfg();
  c.num_hidden_layers = 6;
  auto m = DecoderModel::from_named(c, random_weights(c, 8, at::kFloat, 0.05), at::kFloat, at::kCPU);
  auto a = trained_like(c, at::kFloat);
  const auto keep = peak_bytes_for_row(*m, a, 2048, false);
  const auto ckpt = peak_bytes_for_row(*m, a, 2048, true);
  EXPECT_LT(static_cast<double>(ckpt), 0.5 * static_cast<double>(keep)) << keep << " vs " << ckpt;
}

// The estimate that refuses rows that cannot fit (training_row_bytes) against the measured peak of
// tensors, on a small model (both modes) and at the measured 1.5B points (bench train, fp32,
// checkpointed, 128-row chunks: 711 / 2394 MiB of step tensors at 1,659 / 5,583 tokens): never
// far below (a refusal would come too late) nor far above (it would refuse what fits).
TEST(TrainingMemory, RowEstimateBracketsTheMeasuredPeak) {
  auto c = small_cfg();
  c.vocab_size = 4096;
  auto m = DecoderModel::from_named(c, random_weights(c, 7, at::kFloat, 0.05), at::kFloat, at::kCPU);
  auto a = trained_like(c, at::kFloat);
  for (bool ckpt : {false, true}) {
    const double measured = static_cast<double>(peak_bytes_for_row(*m, a, 2048, ckpt));
    const double est = static_cast<double>(training_row_bytes(c, at::kFloat, 2048, 128, ckpt));
    EXPECT_GT(est / measured, 0.7) << (ckpt ? "checkpointed " : "kept ") << est << " vs " << measured;
    EXPECT_LT(est / measured, 2.0) << (ckpt ? "checkpointed " : "kept ") << est << " vs " << measured;
  }
  const auto big = ModelConfig::preset("qwen2.5-1.5b-shape");
  constexpr double MiB = 1024.0 * 1024;
  for (auto [tokens, mib] : {std::pair<std::int64_t, double>{1659, 711}, {5583, 2394}}) {
    const double r = static_cast<double>(training_row_bytes(big, at::kFloat, tokens, 128, true)) / MiB / mib;
    EXPECT_GT(r, 0.98) << tokens << " tokens";
    EXPECT_LT(r, 1.2) << tokens << " tokens";
  }
  // Checkpointing needs far less per token; bf16 half of fp32.
  EXPECT_LT(training_row_bytes(big, at::kFloat, 16384, 128, true), training_row_bytes(big, at::kFloat, 16384, 128, false) / 5);
  EXPECT_NEAR(static_cast<double>(training_row_bytes(big, at::kBFloat16, 16384, 1, true)),
              static_cast<double>(training_row_bytes(big, at::kFloat, 16384, 1, true)) / 2, 1e6);
  EXPECT_GT(available_memory_bytes(at::kCPU), std::int64_t{64} << 20);
}

TEST(CpuBlockCache, FreedLargeBlocksAreReusedUpToTheCap) {
  use_cpu_block_cache(std::size_t{64} << 20);
  void* first = nullptr;
  {
    auto t = at::empty({3 << 20}, at::TensorOptions().dtype(at::kFloat));  // 12 MiB: cached when freed
    first = t.data_ptr();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % (std::uintptr_t{2} << 20), 0u);  // huge-page aligned
    t.fill_(1.5f);
  }
  {
    auto t = at::empty({3 << 20}, at::TensorOptions().dtype(at::kFloat));
    EXPECT_EQ(t.data_ptr(), first);  // the same block, no new mapping
    t.fill_(2.0f);
    EXPECT_EQ(t.sum().item<double>(), 2.0 * (3 << 20));
  }
  EXPECT_EQ(use_cpu_block_cache(std::size_t{64} << 20), std::size_t{12} << 20);
  {
    auto big = at::empty({20 << 20}, at::TensorOptions().dtype(at::kFloat));  // 80 MiB: over the cap
    big.zero_();
  }
  EXPECT_EQ(use_cpu_block_cache(std::size_t{64} << 20), std::size_t{12} << 20);  // not kept
  EXPECT_EQ(use_cpu_block_cache(0), 0u);  // a lower cap releases what it holds
  {
    auto small = at::ones({1000});  // small tensors go to libtorch's own allocator
    EXPECT_EQ(small.sum().item<double>(), 1000.0);
  }
}

}  // namespace
}  // namespace lorasync::model
