#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>

#include "core/io/checkpoint_dir.h"
#include "core/model/device_kernels.h"
#include "core/model/logprobs.h"
#include "core/model/decoder_model.h"
#include "core/model/runtime.h"
#include "reference_qwen2.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::model {
namespace {

ModelConfig test_config(bool tied = false, double theta = 10000.0) {
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 1000;
  c.intermediate_size = 96;
  c.tie_word_embeddings = tied;
  c.rope_theta = theta;
  return c;
}

// std 0.2 gives logits of a few units (a meaningful numeric check); the cache tests use 0.1 so
// that fp32 GEMM reassociation (M = 1 vs M = n kernels) stays well inside their 1e-5 bar.
std::unique_ptr<DecoderModel> make_model(const ModelConfig& c, NamedTensors* keep = nullptr,
                                       std::uint64_t seed = 1, double std = 0.2) {
  auto w = random_weights(c, seed, at::kFloat, std);
  if (keep) *keep = w;
  return DecoderModel::from_named(c, w, at::kFloat, at::kCPU);
}

// LoRA on every linear layer, alpha = 2 x rank.
LoraConfig all_linear(std::int64_t rank) {
  LoraConfig lc;
  lc.rank = rank;
  lc.alpha = static_cast<double>(2 * rank);
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  return lc;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

std::vector<std::int64_t> random_ids(std::mt19937& rng, int n, std::int64_t vocab) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<std::int64_t>(rng() % static_cast<unsigned>(vocab));
  return v;
}

TEST(Rope, MatchesClosedForm) {
  const std::int64_t hd = 8, T = 5;
  auto inv = rope_inv_freq(hd, 10000.0, at::kCPU);
  auto pos = at::arange(0, T, at::kLong) * 37;  // far positions too
  auto [cos, sin] = rope_cos_sin(pos, inv);
  auto x = at::randn({T, 2, hd}, at::kFloat);
  auto y = apply_rope(x, cos, sin);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t i = 0; i < hd / 2; ++i) {
        double p = static_cast<double>(t * 37);
        double a = p / std::pow(10000.0, 2.0 * static_cast<double>(i) / hd);
        double x1 = x[t][h][i].item<double>(), x2 = x[t][h][i + hd / 2].item<double>();
        EXPECT_NEAR(y[t][h][i].item<double>(), x1 * std::cos(a) - x2 * std::sin(a), 2e-4);
        EXPECT_NEAR(y[t][h][i + hd / 2].item<double>(), x2 * std::cos(a) + x1 * std::sin(a), 2e-4);
      }
}

TEST(RmsNorm, EpsInsideSqrtWeightAfter) {
  auto x = at::tensor({3.0f, 4.0f});
  auto w = at::tensor({2.0f, 0.5f});
  auto y = rms_norm(x, w, 1e-6);
  double inv = 1.0 / std::sqrt((9.0 + 16.0) / 2 + 1e-6);
  EXPECT_NEAR(y[0].item<double>(), 2 * 3 * inv, 1e-6);
  EXPECT_NEAR(y[1].item<double>(), 0.5 * 4 * inv, 1e-6);
}

TEST(Attention, MatchesNaiveFormulaWithGqa) {
  const std::int64_t L = 4, past = 3, S = past + L, nh = 6, nkv = 2, hd = 4;
  auto q = at::randn({L, nh, hd}), k = at::randn({S, nkv, hd}), v = at::randn({S, nkv, hd});
  auto out = segment_attention(q, k, v, past).view({L, nh, hd});
  for (std::int64_t i = 0; i < L; ++i)
    for (std::int64_t h = 0; h < nh; ++h) {
      const std::int64_t kvh = h / (nh / nkv);
      std::vector<double> sc;
      for (std::int64_t j = 0; j <= past + i; ++j)
        sc.push_back((q[i][h] * k[j][kvh]).sum().item<double>() / 2.0);  // sqrt(4)
      double mx = *std::max_element(sc.begin(), sc.end()), z = 0;
      for (auto& s : sc) z += (s = std::exp(s - mx));
      for (std::int64_t e = 0; e < hd; ++e) {
        double want = 0;
        for (std::size_t j = 0; j < sc.size(); ++j) want += sc[j] / z * v[static_cast<std::int64_t>(j)][kvh][e].item<double>();
        EXPECT_NEAR(out[i][h][e].item<double>(), want, 1e-5);
      }
    }
}

// The fused path (scaled_dot_product_attention) against the explicit formula, values and
// gradients, over the cases the model uses: a whole causal segment, a segment continuing a cache
// (masked), one decode query, with and without GQA.
TEST(Attention, FusedEqualsReferenceWithGradients) {
  struct Case {
    std::int64_t L, past, nh, nkv;
  };
  for (const Case& c : {Case{7, 0, 4, 4}, Case{9, 0, 6, 2}, Case{5, 4, 6, 2}, Case{1, 11, 4, 1},
                        Case{3, 2, 8, 8}}) {
    const std::int64_t S = c.past + c.L, hd = 8;
    at::manual_seed(static_cast<std::uint64_t>(c.L * 100 + c.past));
    auto q = at::randn({c.L, c.nh, hd}).requires_grad_(), k = at::randn({S, c.nkv, hd}).requires_grad_(),
         v = at::randn({S, c.nkv, hd}).requires_grad_();
    auto dy = at::randn({c.L, c.nh * hd});
    auto grads = [&] {
      std::vector<at::Tensor> g;
      for (auto* t : {&q, &k, &v}) {
        g.push_back(t->grad().clone());
        t->mutable_grad().zero_();
      }
      return g;
    };
    auto fused = segment_attention(q, k, v, c.past);
    (fused * dy).sum().backward();
    auto gf = grads();
    auto ref = segment_attention_reference(q, k, v, c.past);
    (ref * dy).sum().backward();
    auto gr = grads();
    const double diff = (fused - ref).abs().max().item<double>();
    EXPECT_LT(diff, 1e-5) << "L=" << c.L << " past=" << c.past << " nh=" << c.nh << " nkv=" << c.nkv;
    for (int i = 0; i < 3; ++i) {
      const double gd = (gf[static_cast<std::size_t>(i)] - gr[static_cast<std::size_t>(i)]).abs().max().item<double>();
      EXPECT_LT(gd, 1e-4) << "grad " << i << " L=" << c.L << " past=" << c.past;
    }
  }
}

// Device dispatch: on CPU the reference runs; the CUDA kernel refuses CPU tensors by name.
TEST(DeviceKernels, RmsNormDispatchesToTheReferenceOnCpu) {
  auto x = at::randn({5, 16}), w = at::randn({16});
  EXPECT_TRUE(at::equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)));
  try {
    (void)cuda::rms_norm(x, w, 1e-6);
    FAIL() << "cuda::rms_norm accepted CPU tensors";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("rms_norm"), std::string::npos) << e.what();
  }
}

class LogitsVsReference : public ::testing::TestWithParam<std::tuple<bool, double>> {};

TEST_P(LogitsVsReference, WithinOneEMinus4) {
  auto [tied, theta] = GetParam();
  auto c = test_config(tied, theta);
  NamedTensors w;
  auto m = make_model(c, &w, 7);
  std::map<std::string, at::Tensor> wm(w.begin(), w.end());
  std::mt19937 rng(3);
  auto ids = random_ids(rng, 9, c.vocab_size);
  auto ref = testing::reference_logits(c, wm, ids);
  at::NoGradGuard ng;
  auto got = m->logits(m->forward(make_batch({ids}, {}, at::kCPU)));
  double worst = 0;
  for (std::size_t t = 0; t < ids.size(); ++t)
    for (std::int64_t v = 0; v < c.vocab_size; ++v)
      worst = std::max(worst, std::abs(got[static_cast<std::int64_t>(t)][v].item<double>() - ref[t][static_cast<std::size_t>(v)]));
  EXPECT_LE(worst, 1e-4) << "largest |logit difference| = " << worst;
  EXPECT_GT(got.abs().max().item<double>(), 0.1) << "logits should not be trivially small";
}

INSTANTIATE_TEST_SUITE_P(TiedAndTheta, LogitsVsReference,
                         ::testing::Values(std::make_tuple(false, 10000.0), std::make_tuple(true, 1e6)));

TEST(Forward, CachedDecodeEqualsFullForwardInEveryFamily) {
  // Prefill of 9, a chunk of 6 after cached context (chunked prefill), then decode one at a time.
  // The cached steps run cpu_decode.cpp (q/k norms in place, biases optional); the full forward
  // runs the libtorch path: the two implementations of each family's maths agree.
  for (auto fam : {ModelFamily::kQwen2, ModelFamily::kQwen3, ModelFamily::kLlama}) {
    for (bool bias : {false, true}) {
      if (fam == ModelFamily::kQwen2 && !bias) continue;
      auto c = test_config().as_family(fam);
      c.attention_bias = bias;
      if (fam == ModelFamily::kLlama) c.rope_llama3 = RopeLlama3{8.0, 1.0, 4.0, 16};  // scaling in use at these positions
      auto m = make_model(c, nullptr, 3, 0.1);
      std::mt19937 rng(7);
      auto ids = random_ids(rng, 24, c.vocab_size);
      at::NoGradGuard ng;
      auto full = m->logits(m->forward(make_batch({ids}, {}, at::kCPU)));
      ContiguousKvCache cache(c, 1, 32, at::kFloat, at::kCPU);
      std::vector<at::Tensor> parts;
      std::int64_t pos = 0;
      for (int n : {9, 6, 1, 1, 1, 1, 1, 1, 1, 1, 1}) {
        std::vector<std::int64_t> chunk(ids.begin() + pos, ids.begin() + pos + n);
        auto b = make_batch({chunk}, {pos}, at::kCPU);
        auto meta = cache.plan(b.segs, {0});
        parts.push_back(m->logits(m->forward(b, nullptr, &cache.pool(), &meta)));
        pos += n;
      }
      const double diff = max_abs_diff(at::cat(parts), full);
      EXPECT_LE(diff, 1e-5) << family_name(fam) << " bias " << bias << ": max |cached - full| = " << diff;
    }
  }
}

TEST(Families, WeightsFollowTheConfigAndAnUnknownFamilyIsNamed) {
  auto q3 = ModelConfig::preset("qwen3-tiny");
  auto w = random_weights(q3, 1, at::kFloat);
  auto has = [&](const std::string& n) {
    return std::any_of(w.begin(), w.end(), [&](const auto& x) { return x.first == n; });
  };
  EXPECT_TRUE(has("model.layers.0.self_attn.q_norm.weight"));
  EXPECT_FALSE(has("model.layers.0.self_attn.q_proj.bias"));
  auto m = DecoderModel::from_named(q3, w, at::kFloat, at::kCPU);
  EXPECT_EQ(m->named_weights().size(), w.size());
  // A qwen3 checkpoint without its q/k norms is refused, naming the tensor.
  NamedTensors missing;
  for (auto& x : w)
    if (x.first.find("k_norm") == std::string::npos) missing.push_back(x);
  try {
    (void)DecoderModel::from_named(q3, missing, at::kFloat, at::kCPU, "ckpt");
    ADD_FAILURE() << "loaded without k_norm";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("self_attn.k_norm.weight"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)parse_family("mistral"), Error);
  EXPECT_EQ(parse_family("llama3"), ModelFamily::kLlama);
}

TEST(Forward, VariableLengthBatchEqualsEachAlone) {
  auto c = test_config();
  auto m = make_model(c);
  std::mt19937 rng(11);
  std::vector<std::vector<std::int64_t>> seqs = {random_ids(rng, 7, c.vocab_size),
                                                 random_ids(rng, 1, c.vocab_size),
                                                 random_ids(rng, 13, c.vocab_size)};
  at::NoGradGuard ng;
  auto batched = m->logits(m->forward(make_batch(seqs, {}, at::kCPU)));
  std::int64_t off = 0;
  for (const auto& s : seqs) {
    auto alone = m->logits(m->forward(make_batch({s}, {}, at::kCPU)));
    auto n = static_cast<std::int64_t>(s.size());
    double diff = max_abs_diff(batched.narrow(0, off, n), alone);
    EXPECT_LE(diff, 1e-5) << "segment at " << off << " differs by " << diff;
    off += n;
  }
}

TEST(Forward, BatchedDecodeEqualsPerSequenceDecode) {
  auto c = test_config();
  auto m = make_model(c, nullptr, 1, 0.1);
  std::mt19937 rng(12);
  std::vector<std::vector<std::int64_t>> prompts = {random_ids(rng, 3, c.vocab_size),
                                                    random_ids(rng, 9, c.vocab_size),
                                                    random_ids(rng, 5, c.vocab_size)};
  auto nexts = random_ids(rng, 3, c.vocab_size);
  at::NoGradGuard ng;
  ContiguousKvCache cache(c, 3, 16, at::kFloat, at::kCPU);
  auto pb = make_batch(prompts, {}, at::kCPU);
  auto pm = cache.plan(pb.segs, {0, 1, 2});
  m->forward(pb, nullptr, &cache.pool(), &pm);
  auto db = make_batch({{nexts[0]}, {nexts[1]}, {nexts[2]}}, {3, 9, 5}, at::kCPU);
  auto dm = cache.plan(db.segs, {0, 1, 2}, /*batched_decode=*/true);
  ASSERT_TRUE(dm.decode_slots.defined());
  auto got = m->logits(m->forward(db, nullptr, &cache.pool(), &dm));
  for (int i = 0; i < 3; ++i) {
    auto s = prompts[static_cast<std::size_t>(i)];
    s.push_back(nexts[static_cast<std::size_t>(i)]);
    auto full = m->logits(m->forward(make_batch({s}, {}, at::kCPU)));
    double diff = max_abs_diff(got[i], full[full.size(0) - 1]);
    EXPECT_LE(diff, 1e-5) << "sequence " << i;
  }
}

TEST(Attention, PagedDecodeReadsEachSequencesScatteredSlotsOnly) {
  // A pool whose slots are dealt to three sequences out of order, plus slots no one owns (they
  // must not leak into any softmax): each row equals that sequence's attention over its own keys.
  const std::int64_t nh = 6, nkv = 2, hd = 16, n_slots = 40;
  at::manual_seed(3);
  auto kp = at::randn({n_slots, nkv, hd}), vp = at::randn({n_slots, nkv, hd});
  auto perm = at::randperm(n_slots, at::TensorOptions().dtype(at::kLong));
  const std::vector<std::int64_t> lens = {1, 11, 7};
  const std::int64_t B = 3, Lmax = 11;
  auto q = at::randn({B, nh, hd});
  auto slots = at::zeros({B, Lmax}, at::TensorOptions().dtype(at::kLong));
  auto bias = at::full({B, Lmax}, -std::numeric_limits<float>::infinity());
  std::int64_t next = 0;
  std::vector<at::Tensor> own;
  for (std::int64_t b = 0; b < B; ++b) {
    auto mine = perm.narrow(0, next, lens[static_cast<std::size_t>(b)]);
    next += lens[static_cast<std::size_t>(b)];
    slots[b].narrow(0, 0, mine.size(0)).copy_(mine);
    bias[b].narrow(0, 0, mine.size(0)).zero_();
    own.push_back(mine);
  }
  auto lens_t = at::tensor(lens, at::TensorOptions().dtype(at::kLong));
  auto got = paged_decode_attention(q, kp, vp, slots, bias, lens_t);  // the reference on CPU
  ASSERT_EQ(got.sizes(), (std::vector<std::int64_t>{B, nh * hd}));
  EXPECT_EQ(max_abs_diff(got, paged_decode_attention_reference(q, kp, vp, slots, bias)), 0.0);
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& s = own[static_cast<std::size_t>(b)];
    auto want = segment_attention_reference(q.narrow(0, b, 1), kp.index_select(0, s), vp.index_select(0, s),
                                            s.size(0) - 1);
    EXPECT_LE(max_abs_diff(got.narrow(0, b, 1), want), 1e-5) << "sequence " << b;
  }
}

TEST(KvCache, BatchedDecodePlanCarriesEachSequencesLength) {
  auto c = test_config();
  ContiguousKvCache cache(c, 3, 16, at::kFloat, at::kCPU);
  auto pm = cache.plan({{0, 4, 0}, {4, 2, 0}, {6, 9, 0}}, {0, 1, 2});
  EXPECT_FALSE(pm.decode_lens.defined()) << "prefill has no decode table";
  auto dm = cache.plan({{0, 1, 4}, {1, 1, 2}, {2, 1, 9}}, {0, 1, 2});
  ASSERT_TRUE(dm.decode_lens.defined());
  EXPECT_TRUE(at::equal(dm.decode_lens, at::tensor(std::vector<std::int64_t>{5, 3, 10})));
  EXPECT_EQ(dm.decode_slots.size(1), 10);
}

TEST(Lora, ZeroBEqualsBaseAndMergedEqualsUnmerged) {
  auto c = test_config();
  NamedTensors w;
  auto m = make_model(c, &w);
  LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  auto ad = LoraAdapter::init(lc, c, 9, at::kCPU);
  std::mt19937 rng(2);
  auto ids = random_ids(rng, 10, c.vocab_size);
  at::NoGradGuard ng;
  auto base = m->logits(m->forward(make_batch({ids}, {}, at::kCPU)));
  auto lb = LoraBatch::all(&ad);
  auto with_zero_b = m->logits(m->forward(make_batch({ids}, {}, at::kCPU), &lb));
  EXPECT_EQ(max_abs_diff(base, with_zero_b), 0.0);
  for (std::int64_t l = 0; l < ad.n_layers(); ++l)
    for (auto mod : lc.targets) ad.B(l, mod).normal_(0, 0.5);
  auto unmerged = m->logits(m->forward(make_batch({ids}, {}, at::kCPU), &lb));
  EXPECT_GT(max_abs_diff(unmerged, base), 1e-3) << "a non-zero B must change the logits";
  m->merge_lora(ad);
  auto merged = m->logits(m->forward(make_batch({ids}, {}, at::kCPU)));
  EXPECT_LE(max_abs_diff(merged, unmerged), 1e-4);
  m->merge_lora(ad, -1.0);
  auto back = m->logits(m->forward(make_batch({ids}, {}, at::kCPU)));
  EXPECT_LE(max_abs_diff(back, base), 1e-4);
}

TEST(Lora, OnlyAdapterRequiresGradAndInitLikePeft) {
  auto c = test_config();
  auto m = make_model(c);
  LoraConfig lc;
  lc.rank = 2;
  lc.targets = LoraConfig::parse_targets({"q_proj", "v"});
  auto ad = LoraAdapter::init(lc, c, 1, at::kCPU);
  ad.set_requires_grad(true);
  const double bound = 1.0 / std::sqrt(static_cast<double>(c.hidden_size));
  EXPECT_LE(ad.A(0, LoraModule::kQ).abs().max().item<double>(), bound);
  EXPECT_EQ(ad.B(0, LoraModule::kQ).abs().max().item<double>(), 0.0);
  EXPECT_FALSE(ad.A(0, LoraModule::kK).defined());
  for (const auto& [n, t] : m->named_weights()) EXPECT_FALSE(t.requires_grad()) << n;
  auto lb = LoraBatch::all(&ad);
  auto loss = m->logits(m->forward(make_batch({{1, 2, 3}}, {}, at::kCPU), &lb)).sum();
  loss.backward();
  EXPECT_TRUE(ad.B(0, LoraModule::kQ).grad().defined());
  EXPECT_GT(ad.B(0, LoraModule::kQ).grad().abs().sum().item<double>(), 0);
}

TEST(Lora, MixedAdaptersInOneBatchEqualEachAlone) {
  auto c = test_config();
  auto m = make_model(c);
  const LoraConfig lc = all_linear(2);
  std::vector<LoraAdapter> ads;
  for (int i = 0; i < 2; ++i) {
    ads.push_back(LoraAdapter::init(lc, c, 10 + static_cast<std::uint64_t>(i), at::kCPU));
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l)
      for (auto mod : lc.targets) ads.back().B(l, mod).normal_(0, 0.3);
  }
  std::mt19937 rng(8);
  std::vector<std::vector<std::int64_t>> seqs = {random_ids(rng, 4, c.vocab_size),
                                                 random_ids(rng, 6, c.vocab_size),
                                                 random_ids(rng, 3, c.vocab_size)};
  std::vector<int> slot_of_seq = {0, -1, 1};
  std::vector<int> rows;
  for (std::size_t i = 0; i < seqs.size(); ++i) rows.insert(rows.end(), seqs[i].size(), slot_of_seq[i]);
  auto lb = LoraBatch::from_row_slots({&ads[0], &ads[1]}, rows, at::kCPU);
  at::NoGradGuard ng;
  auto mixed = m->logits(m->forward(make_batch(seqs, {}, at::kCPU), &lb));
  std::int64_t off = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    auto one = LoraBatch::all(slot_of_seq[i] < 0 ? nullptr : &ads[static_cast<std::size_t>(slot_of_seq[i])]);
    auto alone = m->logits(m->forward(make_batch({seqs[i]}, {}, at::kCPU), &one));
    auto n = static_cast<std::int64_t>(seqs[i].size());
    EXPECT_LE(max_abs_diff(mixed.narrow(0, off, n), alone), 1e-5) << "sequence " << i;
    off += n;
  }
}

TEST(Lora, TilesGroupEachAdaptersRowsInOrderAndCoverEveryRowOnce) {
  // Rows dealt round-robin to three adapters and the base model, as a decode batch is, plus one
  // adapter with more rows than a tile holds.
  std::vector<int> part_of_row;
  for (int r = 0; r < 40; ++r) part_of_row.push_back(r % 4 == 3 ? -1 : r % 4);
  for (int r = 0; r < 21; ++r) part_of_row.push_back(2);
  const int rows_per_tile = 4;
  std::vector<std::vector<std::int64_t>> rows_of_part(3);
  for (std::size_t r = 0; r < part_of_row.size(); ++r)
    if (part_of_row[r] >= 0) rows_of_part[static_cast<std::size_t>(part_of_row[r])].push_back(static_cast<std::int64_t>(r));
  auto t = lora_tiles(rows_of_part, rows_per_tile);
  ASSERT_EQ(t.size() % (2 + rows_per_tile), 0u);
  std::vector<int> seen(part_of_row.size(), 0);
  int last_part = -1, last_row = -1;
  for (std::size_t i = 0; i < t.size(); i += 2 + rows_per_tile) {
    const int part = t[i], count = t[i + 1];
    ASSERT_GE(count, 1);
    ASSERT_LE(count, rows_per_tile);
    EXPECT_GE(part, last_part) << "parts in increasing order";
    if (part != last_part) last_row = -1;
    for (int k = 0; k < rows_per_tile; ++k) {
      const int r = t[i + 2 + static_cast<std::size_t>(k)];
      if (k >= count) {
        EXPECT_EQ(r, 0) << "padding";
        continue;
      }
      EXPECT_EQ(part_of_row.at(static_cast<std::size_t>(r)), part) << "row " << r;
      EXPECT_GT(r, last_row) << "rows ascending within a part";
      last_row = r;
      ++seen[static_cast<std::size_t>(r)];
    }
    last_part = part;
  }
  for (std::size_t r = 0; r < part_of_row.size(); ++r)
    EXPECT_EQ(seen[r], part_of_row[r] < 0 ? 0 : 1) << "row " << r;
  EXPECT_TRUE(lora_tiles({}, 16).empty());
}

TEST(Lora, BatchedKernelOnlyOnCudaBatchesWithTheKernels) {
  auto c = test_config();
  auto ad = LoraAdapter::init(all_linear(2), c, 1, at::kCPU);
  EXPECT_FALSE(LoraBatch::from_row_slots({&ad}, {0, -1, 0}, at::kCPU).batched_kernel());
  EXPECT_FALSE(LoraBatch::all(&ad).batched_kernel());
}

TEST(Lora, PeftRoundTripIsBitExact) {
  auto c = test_config();
  LoraConfig lc;
  lc.rank = 3;
  lc.alpha = 6;
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  lc.base_model_name_or_path = "test/base";
  auto ad = LoraAdapter::init(lc, c, 4, at::kCPU);
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (auto mod : lc.targets) ad.B(l, mod).normal_(0, 1);
  TempDir d;
  ad.save_peft(d.path() / "a");
  auto back = LoraAdapter::load_peft(d.path() / "a", c, at::kCPU);
  EXPECT_EQ(back.config().rank, 3);
  EXPECT_EQ(back.config().alpha, 6);
  EXPECT_EQ(back.config().targets, lc.targets);
  auto p1 = ad.parameters(), p2 = back.parameters();
  ASSERT_EQ(p1.size(), p2.size());
  for (std::size_t i = 0; i < p1.size(); ++i) EXPECT_TRUE(at::equal(p1[i], p2[i])) << i;
  // Saving again gives the same bytes.
  back.save_peft(d.path() / "b");
  EXPECT_EQ(read_file(d.path() / "a" / "adapter_model.safetensors"),
            read_file(d.path() / "b" / "adapter_model.safetensors"));
}

TEST(Lora, LoadsIndependentlyWrittenPeftAdapter) {
  // Written by hand in PEFT's layout (not by save_peft): rank 1, alpha 2, q and down only.
  auto c = test_config();
  TempDir d;
  write_file_atomic(d.path() / "adapter_config.json",
                    R"({"peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["down_proj", "q_proj"],
                        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM", "use_dora": false,
                        "use_rslora": false, "modules_to_save": null, "base_model_name_or_path": "x"})");
  std::vector<std::vector<float>> store;
  std::vector<io::TensorToWrite> ts;
  auto add = [&](const std::string& key, std::vector<std::int64_t> shape, float fill) {
    store.emplace_back(static_cast<std::size_t>(shape[0] * shape[1]), fill);
    ts.push_back({key, io::DType::kF32, shape,
                  {reinterpret_cast<const std::uint8_t*>(store.back().data()), store.back().size() * 4}});
  };
  store.reserve(16);
  for (int l = 0; l < 2; ++l) {
    std::string p = "base_model.model.model.layers." + std::to_string(l);
    add(p + ".self_attn.q_proj.lora_A.weight", {1, 64}, 0.01f);
    add(p + ".self_attn.q_proj.lora_B.weight", {64, 1}, 0.02f);
    add(p + ".mlp.down_proj.lora_A.weight", {1, 96}, 0.03f);
    add(p + ".mlp.down_proj.lora_B.weight", {64, 1}, 0.04f);
  }
  io::write_safetensors(d.path() / "adapter_model.safetensors", ts);
  auto ad = LoraAdapter::load_peft(d.path(), c, at::kCPU);
  EXPECT_EQ(ad.config().scaling(), 2.0);
  EXPECT_TRUE(ad.config().targets_module(LoraModule::kDown));
  EXPECT_FALSE(ad.config().targets_module(LoraModule::kK));
  EXPECT_FLOAT_EQ(ad.B(1, LoraModule::kDown)[5][0].item<float>(), 0.04f);
  // Rank over the limit and a wrong shape are refused with clear messages.
  try {
    LoraAdapter::load_peft(d.path(), c, at::kCPU, /*max_rank=*/0);
    auto cc = c;
    cc.intermediate_size = 128;
    LoraAdapter::load_peft(d.path(), cc, at::kCPU);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("down_proj.lora_A.weight"), std::string::npos) << e.what();
  }
}

TEST(Lora, RefusesUnsupportedConfigs) {
  auto expect_msg = [](const std::string& json, const std::string& needle) {
    try {
      LoraConfig::from_peft_json(json, "cfg");
      ADD_FAILURE() << "accepted " << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_msg(R"({"r": 1, "target_modules": ["q_proj"], "use_dora": true})", "DoRA");
  expect_msg(R"({"r": 1, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]})", "modules_to_save");
  expect_msg(R"({"r": 0, "target_modules": ["q_proj"]})", "'r'");
  expect_msg(R"({"r": 1, "target_modules": ["embed_tokens"]})", "embed_tokens");
  expect_msg(R"({"r": 1, "target_modules": ["q_proj"], "peft_type": "IA3"})", "IA3");
  expect_msg("{nope", "not valid JSON");
  // Values of the wrong type are refused by name, never escape as a JSON library exception.
  expect_msg(R"({"r": 1, "target_modules": ["q_proj"], "use_dora": "no"})", "'use_dora' must be true or false");
  expect_msg(R"({"r": 1, "target_modules": ["q_proj"], "lora_dropout": "0.1"})", "'lora_dropout' must be a number");
  expect_msg(R"({"r": 1, "target_modules": ["q_proj"], "base_model_name_or_path": 7})", "'base_model_name_or_path' must be a string");
  expect_msg(R"({"r": 1, "target_modules": ["q_proj"], "bias": false})", "'bias' must be a string");
  expect_msg(R"({"r": 1, "target_modules": ["q_proj"], "peft_type": ["LORA"]})", "'peft_type' must be a string");
}

TEST(Config, ValidatesAndNamesProblems) {
  auto good = ModelConfig::preset("qwen2.5-1.5b-shape");
  auto back = ModelConfig::from_json(good.to_json(), "x");
  EXPECT_EQ(back.hidden_size, 1536);
  EXPECT_EQ(back.num_key_value_heads, 2);
  EXPECT_EQ(back.head_dim, 128);
  EXPECT_TRUE(back.tie_word_embeddings);
  EXPECT_NEAR(static_cast<double>(good.n_params()), 1.54e9, 0.02e9);
  auto expect_msg = [](const std::string& json, const std::string& needle) {
    try {
      ModelConfig::from_json(json, "config.json");
      ADD_FAILURE() << "accepted " << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string base = R"("model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2)";
  expect_msg("{" + base + R"(, "num_key_value_heads": 3})", "not a multiple");
  expect_msg("{" + base + R"(, "rope_scaling": {"type": "yarn", "factor": 4}})", "rope_scaling");
  expect_msg("{" + base + R"(, "hidden_act": "gelu"})", "gelu");
  expect_msg(R"({"model_type": "mistral", "vocab_size": 10})", "mistral");
  expect_msg(R"({"model_type": "qwen2", "vocab_size": 10})", "hidden_size");
  expect_msg(R"({"model_type": "qwen2", "vocab_size": "10"})", "'vocab_size' must be an integer");
}

TEST(Config, ReadsEachFamilysKeys) {
  const std::string base =
      R"("vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2)";
  auto q3 = ModelConfig::from_json(R"({"model_type": "qwen3", )" + base + "}", "x");
  EXPECT_EQ(q3.family, ModelFamily::kQwen3);
  EXPECT_TRUE(q3.qk_norm);
  EXPECT_FALSE(q3.attention_bias);
  EXPECT_EQ(q3.head_dim, 128);  // transformers' Qwen3Config default, not hidden / heads
  auto ll = ModelConfig::from_json(
      R"({"architectures": ["LlamaForCausalLM"], "attention_bias": true, )" + base +
          R"(, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
             "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})",
      "x");
  EXPECT_EQ(ll.family, ModelFamily::kLlama);
  EXPECT_TRUE(ll.attention_bias);
  EXPECT_EQ(ll.head_dim, 4);
  EXPECT_DOUBLE_EQ(ll.rope_theta, 500000.0);
  ASSERT_TRUE(ll.rope_llama3.has_value());
  EXPECT_DOUBLE_EQ(ll.rope_llama3->factor, 32.0);
  // to_json round-trips every family.
  for (const char* p : {"qwen3-1.7b-shape", "llama3.2-1b-shape", "tiny"}) {
    auto c = ModelConfig::preset(p);
    auto back = ModelConfig::from_json(c.to_json(), p);
    EXPECT_EQ(back.family, c.family) << p;
    EXPECT_EQ(back.qk_norm, c.qk_norm) << p;
    EXPECT_EQ(back.attention_bias, c.attention_bias) << p;
    EXPECT_EQ(back.head_dim, c.head_dim) << p;
    EXPECT_EQ(back.rope_llama3.has_value(), c.rope_llama3.has_value()) << p;
    EXPECT_EQ(back.n_params(), c.n_params()) << p;
  }
  // Llama-3.2-1B has 1.24e9 parameters, Qwen3-1.7B 1.72e9 (tied embeddings counted once).
  EXPECT_NEAR(static_cast<double>(ModelConfig::preset("llama3.2-1b-shape").n_params()), 1.24e9, 0.01e9);
  EXPECT_NEAR(static_cast<double>(ModelConfig::preset("qwen3-1.7b-shape").n_params()), 1.72e9, 0.01e9);
  auto refused = [&](const std::string& json, const std::string& needle) {
    try {
      (void)ModelConfig::from_json(json, "config.json");
      ADD_FAILURE() << "accepted " << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused(R"({"model_type": "llama", "mlp_bias": true, )" + base + "}", "mlp_bias");
  refused(R"({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}, )" + base + "}", "yarn");
  refused(R"({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
              "high_freq_factor": 1.0}, )" + base + "}",
          "low_freq_factor < high_freq_factor");
}

TEST(Model, ShardedEqualsSingleFileAndBf16Loads) {
  auto c = test_config();
  auto w = random_weights(c, 3, at::kFloat, 0.2);
  TempDir a, b;
  auto write = [&](const fs::path& dir, std::uint64_t shard) {
    std::vector<at::Tensor> keep;
    std::vector<io::TensorToWrite> ts;
    for (const auto& [n, t] : w) {
      auto ct = t.contiguous();
      keep.push_back(ct);
      ts.push_back({n, io::DType::kF32, ct.sizes().vec(),
                    {static_cast<const std::uint8_t*>(ct.data_ptr()), static_cast<std::size_t>(ct.nbytes())}});
    }
    write_file_atomic(dir / "config.json", c.to_json());
    return io::write_weights(dir, ts, shard);
  };
  EXPECT_EQ(write(a.path(), 1ull << 30), 1);
  EXPECT_GT(write(b.path(), 40000), 3);
  auto ma = DecoderModel::load(a.path(), at::kFloat, at::kCPU);
  auto mb = DecoderModel::load(b.path(), at::kFloat, at::kCPU);
  at::NoGradGuard ng;
  auto batch = make_batch({{5, 6, 7, 8}}, {}, at::kCPU);
  EXPECT_TRUE(at::equal(ma->logits(ma->forward(batch)), mb->logits(mb->forward(batch))));
  auto m16 = DecoderModel::load(a.path(), at::kBFloat16, at::kCPU);
  auto l16 = m16->logits(m16->forward(batch));
  EXPECT_EQ(l16.scalar_type(), at::kFloat);
  EXPECT_LT(max_abs_diff(l16, ma->logits(ma->forward(batch))), 0.5);
}

TEST(Logprobs, MatchGenerationAndPackedEqualsAlone) {
  auto c = test_config();
  auto m = make_model(c);
  GenerateOptions opt;
  opt.max_new_tokens = 6;
  opt.temperature = 0.7;
  opt.seed = 3;
  auto g = generate(*m, nullptr, {1, 2, 3}, opt);
  ASSERT_EQ(g.ids.size(), 6u);
  auto lp = completion_logprobs(*m, nullptr, {{{1, 2, 3}, g.ids}, {{9}, {4, 5}}}, 0.7);
  ASSERT_EQ(lp.size(), 2u);
  for (std::size_t i = 0; i < g.ids.size(); ++i) EXPECT_NEAR(lp[0][i], g.logprobs[i], 1e-5);
  auto alone = completion_logprobs(*m, nullptr, {{{9}, {4, 5}}}, 0.7);
  EXPECT_NEAR(alone[0][1], lp[1][1], 1e-5);
  EXPECT_THROW(completion_logprobs(*m, nullptr, {{{1}, {5000}}}, 1.0), Error);
}

}  // namespace
}  // namespace lorasync::model
