#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <random>

#include "core/model/decoder_model.h"
#include "engine/adapter_store.h"
#include "rl/grpo_loss.h"
#include "rl/packed_forward.h"
#include "rl/packing.h"
#include "rl/publisher.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::rl {
namespace {

model::ModelConfig cfg() {
  auto c = model::ModelConfig::preset("tiny");
  c.vocab_size = 512;
  c.intermediate_size = 96;
  return c;
}

std::vector<std::int64_t> ids(std::mt19937& rng, int n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<std::int64_t>(rng() % 512);
  return v;
}

model::LoraAdapter adapter(const model::ModelConfig& c, std::uint64_t seed, c10::ScalarType dt = at::kFloat) {
  model::LoraConfig lc;
  lc.rank = 2;
  lc.alpha = 4;
  lc.targets = model::LoraConfig::parse_targets({"all-linear"});
  auto a = model::LoraAdapter::init(lc, c, seed, at::kCPU);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 9);
  for (std::int64_t l = 0; l < a.n_layers(); ++l)
    for (auto m : lc.targets) {
      a.B(l, m).normal_(0, 0.2, gen);
      a.A(l, m) = a.A(l, m).to(dt);
      a.B(l, m) = a.B(l, m).to(dt);
    }
  return a;
}

TEST(PackedForward, PackedRowEqualsEachSampleAloneAndSegmentsAreIsolated) {
  auto c = cfg();
  auto m = model::DecoderModel::from_named(c, model::random_weights(c, 2, at::kFloat, 0.1), at::kFloat, at::kCPU);
  auto a = adapter(c, 3);
  std::mt19937 rng(4);
  std::vector<PackedSample> row;
  for (int i = 0; i < 4; ++i) row.push_back({ids(rng, 3 + 5 * i), ids(rng, 2 + 3 * i)});
  at::NoGradGuard ng;
  auto packed = packed_row_logprobs(*m, &a, row, 0.8, /*logits_chunk=*/7);
  for (std::size_t i = 0; i < row.size(); ++i) {
    auto alone = packed_row_logprobs(*m, &a, {row[i]}, 0.8);
    const auto o = packed.offsets[i], n = packed.offsets[i + 1] - o;
    EXPECT_LE((packed.logprobs.narrow(0, o, n) - alone.logprobs).abs().max().item<double>(), 1e-5) << i;
    EXPECT_LE((packed.entropy.narrow(0, o, n) - alone.entropy).abs().max().item<double>(), 1e-5) << i;
  }
  // Changing one segment's tokens leaves every other segment's outputs bit-identical.
  auto changed = row;
  changed[1].prompt[0] = (changed[1].prompt[0] + 1) % 512;
  changed[1].completion[0] = (changed[1].completion[0] + 7) % 512;
  auto p2 = packed_row_logprobs(*m, &a, changed, 0.8, 7);
  for (std::size_t i : {0u, 2u, 3u}) {
    const auto o = packed.offsets[i], n = packed.offsets[i + 1] - o;
    EXPECT_TRUE(at::equal(packed.logprobs.narrow(0, o, n), p2.logprobs.narrow(0, o, n))) << i;
  }
}

TEST(PackedForward, LoraGradientMatchesCentralDifferencesInFp64) {
  auto c = cfg();
  auto m = model::DecoderModel::from_named(c, model::random_weights(c, 5, at::kFloat, 0.1), at::kDouble, at::kCPU);
  auto a = adapter(c, 6, at::kDouble);
  a.set_requires_grad(true);
  std::mt19937 rng(7);
  std::vector<PackedSample> row = {{ids(rng, 5), ids(rng, 4)}, {ids(rng, 3), ids(rng, 6)}};
  // Behaviour logprobs near the current ones (ratios inside the clip range), mixed advantages.
  at::Tensor mu, adv;
  {
    at::NoGradGuard ng;
    auto lp0 = packed_row_logprobs(*m, &a, row, 1.0).logprobs;
    mu = lp0 + 0.05 * at::randn(lp0.sizes(), at::TensorOptions().dtype(at::kDouble));
    adv = at::tensor({0.5, 0.5, 0.5, 0.5, -0.3, -0.3, -0.3, -0.3, -0.3, -0.3}, at::TensorOptions().dtype(at::kDouble));
  }
  LossConfig lc;
  lc.old_policy = OldPolicy::kRecompute;
  lc.beta = 0.05;
  auto objective = [&] {
    auto out = packed_row_logprobs(*m, &a, row, 1.0);
    at::Tensor ref;
    {
      at::NoGradGuard ng;
      ref = packed_row_logprobs(*m, nullptr, row, 1.0).logprobs;
    }
    return grpo_token_losses({out.logprobs, mu, mu + 0.01, adv, ref}, lc).sum() / 10.0;
  };
  objective().backward();
  std::mt19937 pick(11);
  const auto params = a.parameters();
  for (int k = 0; k < 20; ++k) {
    const auto& p = params[pick() % params.size()];
    const auto flat = p.numel();
    const auto j = static_cast<std::int64_t>(pick() % static_cast<unsigned>(flat));
    const double g = p.grad().view(-1)[j].item<double>();
    const double h = 1e-6;
    double f_plus, f_minus;
    {
      at::NoGradGuard ng;
      auto v = p.view(-1);
      const double orig = v[j].item<double>();
      v[j].fill_(orig + h);
      f_plus = objective().item<double>();
      v[j].fill_(orig - h);
      f_minus = objective().item<double>();
      v[j].fill_(orig);
    }
    const double num = (f_plus - f_minus) / (2 * h);
    EXPECT_NEAR(g, num, 1e-4 * std::max(std::abs(num), 1e-3)) << "coordinate " << k;
  }
}

TEST(Publisher, AtomicVersionsThatTheServerVerifies) {
  TempDir d;
  auto c = cfg();
  AdapterPublisher pub(d.path() / "adapters", "policy", "tiny", "abc");
  auto a = adapter(c, 1);
  auto p1 = pub.publish(a, 1, 0);
  EXPECT_EQ(p1.name, "policy-v1");
  EXPECT_TRUE(fs::exists(p1.dir / "manifest.json"));
  EXPECT_THROW(pub.publish(a, 1, 4), Error);  // names are never reused
  pub.publish(adapter(c, 2), 2, 4);
  EXPECT_EQ(pub.existing_versions(), (std::vector<std::int64_t>{1, 2}));
  // The server side accepts it and computes the same identity.
  auto loaded = engine::read_adapter("policy-v1", p1.dir.string(), {(d.path() / "adapters").string()}, c, 8, at::kCPU);
  EXPECT_EQ(loaded.sha256, p1.adapter_sha256);
  // A crash mid-publish leaves a staging directory, never a final one; start-up removes it.
  fs::create_directories(d.path() / "adapters" / ".staging-policy-v3-dead");
  EXPECT_EQ(pub.existing_versions().size(), 2u);
  EXPECT_EQ(pub.remove_stale_staging(), 1);
  pub.remove_version(1);
  EXPECT_EQ(pub.existing_versions(), (std::vector<std::int64_t>{2}));
}

}  // namespace
}  // namespace lorasync::rl
