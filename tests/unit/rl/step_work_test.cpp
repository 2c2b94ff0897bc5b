// Unit tests of the data-parallel step (rl/step_work.h, docs/trainer.md "Data-parallel ranks"): messages round-trip and
// corrupted ones are refused with an error (never a crash); samples are spread over ranks by FLOPs,
// every rank fed; per-rank statistics merge; and the core claim: the gradients of the shares,
// summed, equal the single-process step's gradients.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>

#include "core/model/logprobs.h"
#include "core/model/decoder_model.h"
#include "rl/step_work.h"
#include "util/error.h"

namespace lorasync::rl {
namespace {

model::ModelConfig tiny() {
  auto c = model::ModelConfig::preset("tiny");
  c.vocab_size = 512;
  c.intermediate_size = 96;
  return c;
}

StepWork sample_work(std::mt19937& rng, int n, int world) {
  StepWork w;
  w.temperature = 0.9, w.denom = 123.5, w.lr = 3e-4, w.loss_scale = 1.0;
  for (int i = 0; i < n; ++i) {
    StepSample s;
    const int p = 3 + static_cast<int>(rng() % 9), c = 1 + static_cast<int>(rng() % 17);
    for (int k = 0; k < p; ++k) s.prompt.push_back(static_cast<std::int64_t>(rng() % 512));
    for (int k = 0; k < c; ++k) {
      s.completion.push_back(static_cast<std::int64_t>(rng() % 512));
      s.behaviour.push_back(-0.1f * static_cast<float>(1 + rng() % 30));
    }
    s.advantage = static_cast<float>(static_cast<int>(rng() % 7) - 3) / 3.0f;
    s.version = 1 + (i % 2);
    s.group = i / 4, s.member = i % 4;
    w.samples.push_back(std::move(s));
  }
  w.owner = assign_ranks(w.samples, world, tiny());
  return w;
}

TEST(StepWork, MessagesRoundTrip) {
  std::mt19937 rng(7);
  StepWork w = sample_work(rng, 9, 3);
  w.versions[2] = {torch::randn({2, 5}), torch::randn({7, 2})};
  w.keep_versions = {1, 2};
  const StepWork d = decode_step_work(encode_step_work(w), "test");
  EXPECT_EQ(d.kind, "step");
  ASSERT_EQ(d.samples.size(), w.samples.size());
  for (std::size_t i = 0; i < w.samples.size(); ++i) {
    EXPECT_EQ(d.samples[i].prompt, w.samples[i].prompt);
    EXPECT_EQ(d.samples[i].completion, w.samples[i].completion);
    EXPECT_EQ(d.samples[i].behaviour, w.samples[i].behaviour);
    EXPECT_EQ(d.samples[i].advantage, w.samples[i].advantage);
    EXPECT_EQ(d.samples[i].version, w.samples[i].version);
    EXPECT_EQ(d.samples[i].group, w.samples[i].group);
    EXPECT_EQ(d.samples[i].member, w.samples[i].member);
  }
  EXPECT_EQ(d.owner, w.owner);
  EXPECT_EQ(d.temperature, w.temperature);  // exact: sent as F64
  EXPECT_EQ(d.denom, w.denom);
  EXPECT_EQ(d.lr, w.lr);
  EXPECT_EQ(d.keep_versions, w.keep_versions);
  ASSERT_EQ(d.versions.size(), 1u);
  ASSERT_EQ(d.versions.at(2).size(), 2u);
  EXPECT_TRUE(torch::equal(d.versions.at(2)[1], w.versions.at(2)[1]));

  StepWork stop;
  stop.kind = "abort";
  stop.message = "rank 0: no rollout for 600 s";
  const auto s = decode_step_work(encode_step_work(stop), "test");
  EXPECT_EQ(s.kind, "abort");
  EXPECT_EQ(s.message, stop.message);
  EXPECT_EQ(message_kind(encode_config("seed = 1\n"), "test"), "config");
  EXPECT_EQ(decode_config(encode_config("seed = 1\n"), "test"), "seed = 1\n");

  InitState init;
  init.config_toml = "x";
  init.lora_config_json = "{}";
  init.params = {torch::randn({3, 4})};
  init.exp_avg = {torch::randn({3, 4})};
  init.exp_avg_sq = {torch::rand({3, 4})};
  init.optimizer_steps = 17;
  const InitState i2 = decode_init(encode_init(init), "test");
  EXPECT_EQ(i2.optimizer_steps, 17);
  EXPECT_EQ(i2.lora_config_json, "{}");
  EXPECT_TRUE(torch::equal(i2.exp_avg_sq[0], init.exp_avg_sq[0]));
}

// Property: any corruption of a message (flipped bytes, truncation, a foreign format) decodes to a
// valid message or throws lorasync::Error naming the message; never a crash or a wild read.
TEST(StepWork, CorruptedMessagesAreRefusedWithAnError) {
  std::mt19937 rng(11);
  const std::string good = encode_step_work(sample_work(rng, 6, 2));
  int refused = 0, decoded = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bad = good;
    switch (trial % 3) {
      case 0:
        for (int k = 0; k < 1 + trial % 4; ++k) bad[rng() % bad.size()] = static_cast<char>(rng());
        break;
      case 1:
        bad.resize(rng() % bad.size());
        break;
      default: {  // the header's length field or the JSON header itself
        const std::size_t at = rng() % std::min<std::size_t>(bad.size(), 400);
        bad[at] = static_cast<char>(rng());
      }
    }
    try {
      const StepWork w = decode_step_work(bad, "msg/7");
      for (const auto& s : w.samples) EXPECT_EQ(s.behaviour.size(), s.completion.size());
      EXPECT_EQ(w.owner.size(), w.samples.size());
      ++decoded;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("msg/7"), std::string::npos) << e.what();
      ++refused;
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(decoded, 0);  // flips inside token ids are still well-formed messages
  // A message of another format version is refused by name.
  std::string other = encode_config("x");
  const auto at = other.find("\"lorasync_dp\":\"1\"");
  ASSERT_NE(at, std::string::npos);
  other[at + 15] = '9';
  try {
    decode_config(other, "msg/0");
    FAIL() << "a foreign format was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("different lorasync versions"), std::string::npos) << e.what();
  }
}

TEST(StepWork, SamplesAreSpreadOverRanksByFlops) {
  std::mt19937 rng(3);
  StepWork w = sample_work(rng, 40, 1);
  for (auto o : w.owner) EXPECT_EQ(o, 0);
  for (int world : {2, 3, 5, 40}) {
    const auto owner = assign_ranks(w.samples, world, tiny());
    EXPECT_EQ(owner, assign_ranks(w.samples, world, tiny())) << "deterministic";
    std::vector<double> load(static_cast<std::size_t>(world), 0);
    std::vector<int> count(static_cast<std::size_t>(world), 0);
    double biggest = 0, total = 0;
    for (std::size_t i = 0; i < owner.size(); ++i) {
      const double cost = sample_flops(w.samples[i], tiny());
      ASSERT_GE(owner[i], 0);
      ASSERT_LT(owner[i], world);
      load[static_cast<std::size_t>(owner[i])] += cost;
      ++count[static_cast<std::size_t>(owner[i])];
      biggest = std::max(biggest, cost), total += cost;
    }
    for (int c : count) EXPECT_GE(c, 1) << "every rank is fed (" << world << " ranks)";
    // Longest-processing-time first: no rank exceeds the mean by more than the largest sample.
    for (double l : load) EXPECT_LE(l, total / world + biggest * (1 + 1e-12)) << world << " ranks";
  }
}

TEST(StepWork, PerRankStatisticsMerge) {
  ShareResult a, b;
  a.stats.n_tokens = 10, a.stats.ratio_sum = 9.5, a.stats.ratio_min = 0.7, a.stats.ratio_max = 1.2;
  b.stats.n_tokens = 5, b.stats.ratio_sum = 5.5, b.stats.ratio_min = 0.9, b.stats.ratio_max = 1.5;
  a.loss = 0.25, b.loss = -0.5, a.entropy_sum = 3, b.entropy_sum = 4;
  a.fwd_bwd_s = 2, b.fwd_bwd_s = 1, a.rows = 2, b.rows = 1;
  double imb = 0;
  const ShareResult m = ShareResult::merge({a.to_values(), b.to_values()}, &imb);
  EXPECT_EQ(m.stats.n_tokens, 15);
  EXPECT_DOUBLE_EQ(m.stats.ratio_sum, 15.0);
  EXPECT_DOUBLE_EQ(m.stats.ratio_min, 0.7);
  EXPECT_DOUBLE_EQ(m.stats.ratio_max, 1.5);
  EXPECT_DOUBLE_EQ(m.loss, -0.25);
  EXPECT_DOUBLE_EQ(m.entropy_sum, 7);
  EXPECT_DOUBLE_EQ(m.fwd_bwd_s, 2);  // the slowest rank
  EXPECT_DOUBLE_EQ(imb, 2.0 / 1.5);
  EXPECT_EQ(m.rows, 3);
  EXPECT_THROW(ShareResult::merge({{1.0, 2.0}}, nullptr), Error);
}

// The gradients of each rank's share, summed, are the gradients of the whole step (global
// denominators), with the recompute pass reading each sample's version snapshot.
TEST(StepWork, SharesSumToTheWholeStepsGradients) {
  const auto c = tiny();
  auto model = model::DecoderModel::from_named(c, model::random_weights(c, 2, at::kFloat, 0.1), at::kFloat, at::kCPU);
  model::LoraConfig lc;
  lc.rank = 2, lc.alpha = 4;
  lc.targets = model::LoraConfig::parse_targets({"all-linear"});
  model::LoraAdapter adapter = model::LoraAdapter::init(lc, c, 5, at::kCPU);
  {
    torch::NoGradGuard ng;
    for (auto& p : adapter.parameters()) p.add_(torch::randn(p.sizes()) * 0.05);
  }
  std::map<std::int64_t, model::LoraAdapter> versions;
  versions[1] = adapter.clone();
  versions[2] = adapter.clone();
  {
    torch::NoGradGuard ng;
    for (auto& p : versions[2].parameters()) p.add_(torch::randn(p.sizes()) * 0.02);
  }
  adapter.set_requires_grad(true);
  TrainConfig cfg;
  cfg.batching.row_tokens = 48;
  LossConfig loss;
  loss.beta = 0.05;  // the KL pass too
  std::mt19937 rng(5);
  const int world = 3;
  StepWork w = sample_work(rng, 12, world);
  StepContext ctx{*model, adapter, versions, loss, cfg.batching, at::kCPU};
  auto grads = [&] {
    std::vector<at::Tensor> g;
    for (auto& p : adapter.parameters()) {
      g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    return g;
  };
  std::vector<std::size_t> all(w.samples.size());
  std::iota(all.begin(), all.end(), 0);
  const ShareResult whole = compute_share(ctx, w, all);
  const auto g_whole = grads();
  std::vector<at::Tensor> g_sum;
  std::vector<std::vector<double>> parts;
  for (int r = 0; r < world; ++r) {
    const auto mine = samples_of(w.owner, r);
    ASSERT_FALSE(mine.empty());
    parts.push_back(compute_share(ctx, w, mine).to_values());
    auto g = grads();
    if (g_sum.empty()) g_sum = g;
    else
      for (std::size_t i = 0; i < g.size(); ++i) g_sum[i] += g[i];
  }
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < g_sum.size(); ++i) {
    worst = std::max(worst, (g_sum[i] - g_whole[i]).abs().max().item<double>());
    scale = std::max(scale, g_whole[i].abs().max().item<double>());
  }
  EXPECT_GT(scale, 1e-6) << "the step must have gradients to compare";
  EXPECT_LE(worst, 1e-5 * scale);
  const ShareResult merged = ShareResult::merge(parts, nullptr);
  EXPECT_NEAR(merged.loss, whole.loss, 1e-6);
  EXPECT_NEAR(merged.stats.ratio_sum, whole.stats.ratio_sum, 1e-6);
  EXPECT_EQ(merged.stats.n_tokens, whole.stats.n_tokens);
  EXPECT_GE(merged.rows, whole.rows);
  // The flat gradient buffer round-trips (parameters without a gradient count as zeros).
  for (auto& p : adapter.parameters()) p.mutable_grad() = at::Tensor();
  at::Tensor flat = flatten_grads(adapter.parameters());
  EXPECT_EQ(flat.numel(), adapter.n_params());
  EXPECT_EQ(flat.abs().sum().item<double>(), 0.0);
  unflatten_grads(adapter.parameters(), torch::arange(flat.numel(), torch::kFloat32));
  EXPECT_EQ(adapter.parameters()[1].grad().reshape({-1})[0].item<float>(), static_cast<float>(adapter.parameters()[0].numel()));
}

// An episode's sample (rl/episode.h): turn 1 sampled by version 1, the environment's tokens
// (mask 0), turn 2 sampled by version 2. Only the model's tokens are trained (the statistics count
// them alone, and what the masked positions carry changes nothing), and the recompute pass takes
// each token's old policy from its own turn's version: with behaviour logprobs computed under the
// right version per token, every TIS weight is exactly 1 (and it is not when one version is used
// for the whole sample). The mask and versions survive the ranks' messages.
TEST(StepWork, EpisodeSamplesTrainTheModelsTokensUnderTheirOwnVersions) {
  const auto c = tiny();
  auto model = model::DecoderModel::from_named(c, model::random_weights(c, 3, at::kFloat, 0.1), at::kFloat, at::kCPU);
  model::LoraConfig lc;
  lc.rank = 2, lc.alpha = 4;
  lc.targets = model::LoraConfig::parse_targets({"all-linear"});
  model::LoraAdapter adapter = model::LoraAdapter::init(lc, c, 5, at::kCPU);
  std::map<std::int64_t, model::LoraAdapter> versions;
  versions[1] = adapter.clone();
  versions[2] = adapter.clone();
  {
    torch::NoGradGuard ng;
    for (auto& p : versions[1].parameters()) p.add_(torch::randn(p.sizes()) * 0.05);
    for (auto& p : versions[2].parameters()) p.add_(torch::randn(p.sizes()) * 0.3);
  }
  adapter.set_requires_grad(true);
  TrainConfig cfg;
  cfg.batching.row_tokens = 256;
  LossConfig loss;  // recompute, TIS cap 2
  StepSample s;
  s.prompt = {5, 6, 7, 8};
  const std::vector<std::int64_t> t1 = {20, 21, 22}, env = {300, 301, 302, 303}, t2 = {40, 41};
  for (const auto* part : {&t1, &env, &t2}) s.completion.insert(s.completion.end(), part->begin(), part->end());
  for (auto t : t1) (void)t, s.mask.push_back(1), s.versions.push_back(1);
  for (auto t : env) (void)t, s.mask.push_back(0), s.versions.push_back(1);
  for (auto t : t2) (void)t, s.mask.push_back(1), s.versions.push_back(2);
  s.version = 1;
  s.advantage = 0.5f;
  const double temp = 0.9;
  auto lp = [&](std::int64_t v) { return model::completion_logprobs(*model, &versions.at(v), {{s.prompt, s.completion}}, temp)[0]; };
  const auto lp1 = lp(1), lp2 = lp(2);
  for (std::size_t i = 0; i < s.completion.size(); ++i) s.behaviour.push_back(s.versions[i] == 1 ? lp1[i] : lp2[i]);
  StepWork w;
  w.temperature = temp, w.denom = 5, w.lr = 1e-3, w.loss_scale = 1;
  w.samples = {s};
  w.owner = {0};
  StepContext ctx{*model, adapter, versions, loss, cfg.batching, at::kCPU};
  auto grads = [&] {
    std::vector<at::Tensor> g;
    for (auto& p : adapter.parameters()) {
      g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    return g;
  };
  const ShareResult r = compute_share(ctx, w, {0});
  const auto g = grads();
  EXPECT_EQ(r.stats.n_tokens, 5) << "the 3 + 2 model tokens, not the environment's 4";
  EXPECT_NEAR(r.stats.tis_weight_sum, 5.0, 1e-4) << "each token's old policy is its own turn's version";
  EXPECT_LT(r.stats.mismatch_k3_sum, 1e-6);
  // What the masked positions carry is ignored.
  StepWork w2 = w;
  for (std::size_t i = t1.size(); i < t1.size() + env.size(); ++i) w2.samples[0].behaviour[i] = -40.0f;
  const ShareResult r2 = compute_share(ctx, w2, {0});
  const auto g2 = grads();
  EXPECT_DOUBLE_EQ(r2.loss, r.loss);
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(torch::equal(g[i], g2[i])) << i;
  // Control: one version for the whole sample misjudges turn 2's tokens.
  StepWork w3 = w;
  w3.samples[0].versions.clear();
  const ShareResult r3 = compute_share(ctx, w3, {0});
  grads();
  EXPECT_GT(r3.stats.mismatch_k3_sum, 1e-4) << "the control must differ, or the check above proves nothing";
  // Messages between ranks carry the mask and the versions.
  const StepWork d = decode_step_work(encode_step_work(w), "test");
  EXPECT_EQ(d.samples[0].mask, s.mask);
  EXPECT_EQ(d.samples[0].versions, s.versions);
  EXPECT_EQ(d.samples[0].trained_tokens(), 5);
}

// The store carries values of any size: the libuv TCPStore drops a connection that sends more
// than 8 MiB at once, so large messages (a rank-64 adapter's init state, a step with snapshots)
// go in chunks. A one-rank group on a free port, with its own store.
TEST(DistGroup, ValuesLargerThanTheStoresPayloadLimitRoundTrip) {
  DistEnv env;
  env.world = 1;
  env.master_port = 0;  // the store picks a free port
  DistOptions opts;
  opts.timeout_s = 30;
  auto dist = DistGroup::connect(env, opts);
  std::string big(std::size_t{21} << 20, '\0');
  std::mt19937 rng(1);
  for (auto& c : big) c = static_cast<char>(rng());
  dist->set("msg/big", big);
  dist->set("msg/small", "x");
  auto back = dist->get_wait("msg/big", -1, nullptr);
  ASSERT_TRUE(back.has_value());
  EXPECT_TRUE(*back == big);
  EXPECT_EQ(dist->get_wait("msg/small", -1, nullptr), std::optional<std::string>("x"));
  EXPECT_EQ(dist->get_wait("msg/none", -1, [] { return true; }), std::nullopt);
  dist->erase("msg/big");
  EXPECT_EQ(dist->get_wait("msg/big", -1, [] { return true; }), std::nullopt);
  // A one-rank all-reduce is the identity; every rank is alive.
  at::Tensor t = torch::arange(5, torch::kFloat32);
  dist->allreduce_sum(t);
  EXPECT_EQ(t[4].item<float>(), 4.0f);
  EXPECT_TRUE(dist->silent_ranks().empty());
}

}  // namespace
}  // namespace lorasync::rl
