#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "rl/advantages.h"
#include "rl/grpo_loss.h"
#include "rl/packing.h"
#include "util/error.h"

namespace lorasync::rl {
namespace {

TEST(Advantages, HandComputedGroups) {
  auto dr = group_advantages({1, 0, 0, 0}, AdvantageMode::kDrGrpo);
  ASSERT_TRUE(dr);
  EXPECT_DOUBLE_EQ(dr->advantages[0], 0.75);
  EXPECT_DOUBLE_EQ(dr->advantages[1], -0.25);
  auto g = group_advantages({1, 0, 0, 0}, AdvantageMode::kGrpo);
  EXPECT_NEAR(g->std, 0.4330127, 1e-7);
  EXPECT_NEAR(g->advantages[0], 1.7320508, 1e-6);
  EXPECT_NEAR(g->advantages[1], -0.5773503, 1e-6);
  auto eq = group_advantages({0.5, 0.5, 0.5}, AdvantageMode::kGrpo);
  for (double a : eq->advantages) EXPECT_EQ(a, 0.0);
  auto nan = group_advantages({1, NAN, 0}, AdvantageMode::kDrGrpo);
  EXPECT_DOUBLE_EQ(nan->mean, 0.5);
  EXPECT_DOUBLE_EQ(nan->advantages[1], 0.0);
  EXPECT_DOUBLE_EQ(nan->advantages[0], 0.5);
  EXPECT_FALSE(group_advantages({1, NAN, NAN}, AdvantageMode::kDrGrpo));
  EXPECT_THROW(parse_advantage_mode("ppo"), Error);
}

at::Tensor t1(double v) { return at::full({1}, v, at::TensorOptions().dtype(at::kDouble)); }

TEST(GrpoLoss, HandComputedSingleToken) {
  LossConfig c;
  c.old_policy = OldPolicy::kRecompute;
  // rho = 1.5, A = +1: clipped at 1.2, L = -1.2 w, no gradient. exp(old - mu) = 1 -> w = 1.
  auto lp = t1(std::log(1.5)).requires_grad_();
  LossStats st;
  auto L = grpo_token_losses({lp, t1(0.0), t1(0.0), t1(1.0), {}}, c, &st);
  EXPECT_NEAR(L.item<double>(), -1.2, 1e-12);
  L.sum().backward();
  EXPECT_EQ(lp.grad().item<double>(), 0.0);
  EXPECT_EQ(st.clip_high, 1);
  // rho = 1.5, A = -1: L = +1.5 w with gradient (d/dlp of 1.5 = 1.5).
  auto lp2 = t1(std::log(1.5)).requires_grad_();
  auto L2 = grpo_token_losses({lp2, t1(0.0), t1(0.0), t1(-1.0), {}}, c);
  EXPECT_NEAR(L2.item<double>(), 1.5, 1e-12);
  L2.sum().backward();
  EXPECT_NEAR(lp2.grad().item<double>(), 1.5, 1e-12);
  // exp(old - mu) = 3 -> w = C = 2, counted in tis clip.
  auto lp3 = t1(std::log(1.5) + std::log(3.0));
  LossStats st3;
  auto L3 = grpo_token_losses({lp3, t1(0.0), t1(std::log(3.0)), t1(-1.0), {}}, c, &st3);
  EXPECT_NEAR(L3.item<double>(), 2 * 1.5, 1e-12);
  EXPECT_EQ(st3.tis_clipped, 1);
  EXPECT_NEAR(st3.tis_weight_sum, 2.0, 1e-12);
  // step_start: value -A * min(r, C), gradient -min(r, C) * A.
  LossConfig s;
  s.old_policy = OldPolicy::kStepStart;
  for (double r : {0.5, 1.7, 3.0})
    for (double A : {1.0, -1.0}) {
      auto lp4 = t1(std::log(r)).requires_grad_();
      auto L4 = grpo_token_losses({lp4, t1(0.0), {}, t1(A), {}}, s);
      EXPECT_NEAR(L4.item<double>(), -A * std::min(r, 2.0), 1e-12);
      L4.sum().backward();
      EXPECT_NEAR(lp4.grad().item<double>(), -std::min(r, 2.0) * A, 1e-12);
    }
  // behaviour with a TIS cap is refused.
  LossConfig b;
  b.old_policy = OldPolicy::kBehaviour;
  EXPECT_THROW(grpo_token_losses({t1(0.0), t1(0.0), {}, t1(1.0), {}}, b), Error);
}

TEST(GrpoLoss, AggregationsMatchHandSums) {
  // Two samples of 2 and 3 tokens, step_start, no clipping, C = 0: L_t = -A * exp(lp - mu).
  LossConfig c;
  c.old_policy = OldPolicy::kStepStart;
  c.tis_cap = 0;
  auto lp = at::tensor({-1.0, -2.0, -0.5, -1.5, -3.0}, at::TensorOptions().dtype(at::kDouble));
  auto mu = at::tensor({-1.1, -2.0, -0.4, -1.5, -2.9}, at::TensorOptions().dtype(at::kDouble));
  auto adv = at::tensor({0.5, 0.5, -0.25, -0.25, -0.25}, at::TensorOptions().dtype(at::kDouble));
  auto L = grpo_token_losses({lp, mu, {}, adv, {}}, c);
  double sum = 0;
  for (int i = 0; i < 5; ++i) sum += -adv[i].item<double>() * 1.0;  // w = 1, rho = 1
  EXPECT_NEAR(L.sum().item<double>(), sum, 1e-12);
  const double K = 3000;
  const double token_mean = L.sum().item<double>() / 5;
  const double seq_sum_const = (L.narrow(0, 0, 2).sum().item<double>() + L.narrow(0, 2, 3).sum().item<double>()) / (2 * K);
  EXPECT_NEAR(token_mean, sum / 5, 1e-12);
  EXPECT_NEAR(seq_sum_const, sum / 6000, 1e-12);
}

TEST(GrpoLoss, GradientMatchesCentralDifferences) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(-0.15, 0.15);
  for (auto mode : {OldPolicy::kRecompute, OldPolicy::kStepStart, OldPolicy::kBehaviour})
    for (double beta : {0.0, 0.1}) {
      LossConfig c;
      c.old_policy = mode;
      c.beta = beta;
      c.tis_cap = mode == OldPolicy::kBehaviour ? 0.0 : 2.0;
      const int n = 20;
      std::vector<double> lpv, muv, oldv, advv, refv;
      for (int i = 0; i < n; ++i) {
        muv.push_back(-1.0 - i * 0.05);
        oldv.push_back(muv.back() + u(rng));
        lpv.push_back(oldv.back() + u(rng));  // |log rho| < 0.15: away from the 0.2 clip kinks
        advv.push_back(i % 2 ? 0.7 : -0.4);
        refv.push_back(lpv.back() + u(rng));
      }
      auto T = [](const std::vector<double>& v) { return at::tensor(v, at::TensorOptions().dtype(at::kDouble)); };
      auto f = [&](const at::Tensor& lp) {
        return grpo_token_losses({lp, T(muv), T(oldv), T(advv), T(refv)}, c).sum();
      };
      auto lp = T(lpv).requires_grad_();
      f(lp).backward();
      auto g = lp.grad();
      for (int i = 0; i < n; ++i) {
        auto plus = T(lpv), minus = T(lpv);
        const double h = 1e-6;
        if (mode == OldPolicy::kStepStart) {
          // lp_old = sg(lp) is fixed at the evaluation point for the derivative.
          auto base = T(lpv);
          auto fd = [&](double d) {
            auto x = T(lpv);
            x[i] += d;
            TokenInputs in{x, T(muv), {}, T(advv), T(refv)};
            LossConfig rc = c;
            rc.old_policy = OldPolicy::kRecompute;
            in.old = base;
            return grpo_token_losses(in, rc).sum().item<double>();
          };
          const double num = (fd(h) - fd(-h)) / (2 * h);
          EXPECT_NEAR(g[i].item<double>(), num, 1e-4 * std::max(1.0, std::abs(num))) << i;
          continue;
        }
        plus[i] += h;
        minus[i] -= h;
        const double num = (f(plus).item<double>() - f(minus).item<double>()) / (2 * h);
        EXPECT_NEAR(g[i].item<double>(), num, 1e-4 * std::max(1.0, std::abs(num)))
            << "mode " << static_cast<int>(mode) << " beta " << beta << " token " << i;
      }
    }
}

TEST(Packing, DeterministicBalancedAndBounded) {
  std::vector<PackItem> items = {{100, 0, 0}, {90, 0, 1}, {80, 1, 0}, {70, 1, 1}, {60, 2, 0}, {50, 2, 1}, {40, 3, 0}};
  auto p = plan_rows(items, 200);
  // Sum 490 -> 3 rows opened; largest first into the emptiest (by sum L^2) row.
  ASSERT_EQ(p.rows.size(), 3u);
  // 100->r0, 90->r1, 80->r2, 70->r2 (smallest sum L^2), 60->r1, 50->r0, 40->r2.
  EXPECT_EQ(p.rows[0], (std::vector<std::size_t>{0, 5}));
  EXPECT_EQ(p.rows[1], (std::vector<std::size_t>{1, 4}));
  EXPECT_EQ(p.rows[2], (std::vector<std::size_t>{2, 3, 6}));
  for (auto t : p.row_tokens) EXPECT_LE(t, 200);
  EXPECT_NEAR(p.fill, 490.0 / 600.0, 1e-12);
  auto again = plan_rows(items, 200);
  EXPECT_EQ(again.rows, p.rows);
  std::mt19937 rng(1);
  std::vector<PackItem> many;
  for (int i = 0; i < 128; ++i) many.push_back({1 + static_cast<std::int64_t>(rng() % 4096), i / 8, i % 8});
  auto q = plan_rows(many, 16384);
  std::vector<int> seen(many.size(), 0);
  for (std::size_t r = 0; r < q.rows.size(); ++r) {
    std::int64_t t = 0;
    for (auto i : q.rows[r]) {
      ++seen[i];
      t += many[i].length;
    }
    EXPECT_EQ(t, q.row_tokens[r]);
    EXPECT_LE(t, 16384);
  }
  for (int s : seen) EXPECT_EQ(s, 1);
  EXPECT_GT(q.fill, 0.9);
  EXPECT_THROW(plan_rows({{5000, 0, 0}}, 4096), Error);
}

}  // namespace
}  // namespace lorasync::rl

#include "rl/optimizer.h"

namespace lorasync::rl {
namespace {

TEST(AdamW, MatchesTheClosedFormFirstStepsAndClipsGlobally) {
  auto p = at::tensor({1.0f, -2.0f}).requires_grad_();
  AdamW opt({p}, {0.9, 0.95, 1e-8, 0.0});
  p.mutable_grad() = at::tensor({0.5f, -0.25f});
  opt.step(0.1);
  // Step 1: m_hat = g, v_hat = g^2, update = lr * sign(g).
  EXPECT_NEAR(p[0].item<float>(), 1.0f - 0.1f, 1e-6);
  EXPECT_NEAR(p[1].item<float>(), -2.0f + 0.1f, 1e-6);
  EXPECT_EQ(opt.steps(), 1);
  auto q = at::tensor({0.0f, 0.0f}).requires_grad_();
  q.mutable_grad() = at::tensor({3.0f, 4.0f});
  EXPECT_NEAR(clip_grad_norm({q}, 1.0), 5.0, 1e-9);
  EXPECT_NEAR(q.grad().norm().item<float>(), 1.0f, 1e-5);
}

}  // namespace
}  // namespace lorasync::rl

#include "rl/config.h"

namespace lorasync::rl {
namespace {

TEST(TrainConfig, PrecedenceUnknownKeysAndValidation) {
  auto c = TrainConfig::load(std::string(LORASYNC_SOURCE_DIR) + "/configs/sanity-qwen2.5-math-1.5b.toml",
                             {"grpo.advantage=\"grpo\"", "async.max_inflight=64", "model.path=models/x"});
  EXPECT_EQ(c.model.dtype, "fp16");
  EXPECT_EQ(c.grpo.loss_norm_const, 3000);
  EXPECT_EQ(c.grpo.advantage, "grpo");
  EXPECT_EQ(c.async.max_inflight, 64);
  EXPECT_EQ(c.model.path, "models/x");
  EXPECT_EQ(c.lora.target_modules, std::vector<std::string>{"all-linear"});
  EXPECT_NO_THROW(c.validate());
  // The resolved configuration round-trips.
  auto back = TrainConfig::parse(c.to_toml(), "resolved");
  EXPECT_EQ(back.to_toml(), c.to_toml());
  auto expect_msg = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_msg([] { TrainConfig::parse("[grpo]\nnum_generation = 8\n", "f.toml"); }, "unknown key grpo.num_generation");
  expect_msg([] { TrainConfig::parse("seed = \"x\"\n", "f.toml"); }, "seed must be an integer");
  expect_msg([] { TrainConfig::parse("[grpo\n", "f.toml"); }, "not valid TOML");
  expect_msg([] { TrainConfig::parse("", "d", {"nope.key=1"}); }, "unknown key nope.key");
  // A bare word from the command line is a string only when it is UTF-8 (found by the fuzzer:
  // "a\x80" was kept as bytes, written back as "a\u0080" and read as another value).
  expect_msg([] { TrainConfig::parse("", "d", {"logging.metrics_bind=a\x80"}); }, "not valid UTF-8 (byte 22");
  auto v = [](std::vector<std::string> sets) { TrainConfig::parse("", "d", std::move(sets)).validate(); };
  expect_msg([&] { v({"batching.samples_per_step=100"}); }, "multiple of grpo.num_generations");
  expect_msg([&] { v({"batching.row_tokens=1000"}); }, "row_tokens");
  expect_msg([&] { v({"data.max_prompt_tokens=5000"}); }, "max_prompt_tokens");
  expect_msg([&] { v({"grpo.old_policy=\"behaviour\""}); }, "tis_cap = 0");
  expect_msg([&] { v({"grpo.num_generations=1"}); }, "at least 2");
  expect_msg([&] { v({"grpo.reward_weights=[1.0, 2.0]"}); }, "reward_weights");
  expect_msg([&] { v({"generation.top_p=0.9"}); }, "top_p must be 1.0");
  expect_msg([&] { v({"generation.top_k=5"}); }, "top_k must be 0");
  expect_msg([&] { v({"lora.dropout=0.1"}); }, "dropout must be 0");
}

}  // namespace
}  // namespace lorasync::rl
