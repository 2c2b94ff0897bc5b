// GPU tests (label `gpu`): run by scripts/gpu-check on a machine with a CUDA device; every test
// skips where none exists (CI, the development machines). Each kernel or device path is compared
// with its reference, the plain libtorch expression on the CPU in fp32:
//   - our fused RMSNorm kernel (the cuda preset) in fp32, bf16 and fp16 against rms_norm_reference;
//   - fused attention on CUDA (flash / memory-efficient) against segment_attention_reference;
//   - our paged decode attention kernel against the gathered reference (and its time);
//   - our batched LoRA kernel against the per-adapter path (and its time), and a mixed-adapter
//     decode with a KV cache on CUDA against the CPU;
//   - the packed row's varlen flash attention against the per-segment path, with gradients;
//   - decode graphs: captured replays against eager steps on the same static buffers;
//   - a whole random model: bf16 and fp32 logits on CUDA against fp32 on the CPU, with and without
//     a LoRA adapter, and the trainer's packed logprobs with their gradient.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "core/model/decode_graphs.h"
#include "core/model/device_kernels.h"
#include "core/model/kv_cache.h"
#include "core/model/logprobs.h"
#include "core/model/lora.h"
#include "core/model/decoder_model.h"

namespace lorasync::model {
namespace {

bool have_gpu() { return at::hasCUDA(); }

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.cpu().to(at::kDouble) - b.cpu().to(at::kDouble)).abs().max().item<double>();
}

TEST(Gpu, RmsNormKernelMatchesTheReference) {
  REQUIRE_GPU();
  std::printf("gpu: our CUDA kernels %s\n", have_cuda_kernels() ? "present (cuda preset)" : "absent");
  for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (std::int64_t d : {64, 1536, 5000}) {
      auto x = at::randn({37, d}).mul(3).to(dt).cuda();
      auto w = at::randn({d}).to(dt).cuda();
      auto got = rms_norm(x, w, 1e-6);  // the kernel where the build has it
      auto want = rms_norm_reference(x, w, 1e-6);
      const double diff = max_abs_diff(got, want);
      // fp32: reassociated sums; 16-bit: at most one rounding step apart.
      const double tol = dt == at::kFloat ? 1e-5 : (dt == at::kBFloat16 ? 3e-2 : 4e-3);
      EXPECT_LE(diff, tol) << c10::toString(dt) << " d=" << d;
      std::printf("gpu: rms_norm %s d=%lld max |diff| %.3g\n", c10::toString(dt),
                  static_cast<long long>(d), diff);
    }
  }
}

TEST(Gpu, FusedAttentionMatchesTheReference) {
  REQUIRE_GPU();
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    for (std::int64_t past : {0, 9}) {
      const std::int64_t L = 33, S = L + past, nh = 12, nkv = 2, hd = 128;
      auto q = at::randn({L, nh, hd}), k = at::randn({S, nkv, hd}), v = at::randn({S, nkv, hd});
      auto want = segment_attention_reference(q, k, v, past);
      auto got = segment_attention(q.to(dt).cuda(), k.to(dt).cuda(), v.to(dt).cuda(), past);
      const double diff = max_abs_diff(got, want);
      EXPECT_LE(diff, dt == at::kFloat ? 1e-4 : 3e-2) << c10::toString(dt) << " past=" << past;
      std::printf("gpu: attention %s past=%lld max |diff| %.3g\n", c10::toString(dt),
                  static_cast<long long>(past), diff);
    }
  }
}

TEST(Gpu, VarlenFlashAttentionEqualsPerSegmentWithGradients) {
  REQUIRE_GPU();
  const std::int64_t nh = 12, nkv = 2, hd = 128;
  std::vector<Segment> segs;
  std::int64_t T = 0;
  for (std::int64_t len : {37, 5, 128, 1, 64}) {
    segs.push_back({T, len, 0});
    T += len;
  }
  auto q0 = at::randn({T, nh, hd}), k0 = at::randn({T, nkv, hd}), v0 = at::randn({T, nkv, hd});
  auto g = at::randn({T, nh * hd});
  auto run = [&](bool varlen) {
    const bool prev = set_varlen_attention(varlen);
    auto q = q0.to(at::kBFloat16).cuda().requires_grad_(true);
    auto k = k0.to(at::kBFloat16).cuda().requires_grad_(true);
    auto v = v0.to(at::kBFloat16).cuda().requires_grad_(true);
    auto out = packed_attention(q, k, v, segs);
    (out.to(at::kFloat) * g.cuda()).sum().backward();
    set_varlen_attention(prev);
    return std::vector<at::Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
  };
  auto a = run(true), b = run(false);
  const char* names[] = {"out", "dq", "dk", "dv"};
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double scale = b[i].abs().max().item<double>();
    const double diff = max_abs_diff(a[i], b[i]);
    EXPECT_LE(diff, 0.03 * scale + 0.03) << names[i];
    std::printf("gpu: varlen attention %s max |diff| %.3g (max |x| %.3g)\n", names[i], diff, scale);
  }
}

// A decode batch over a pool whose slots are dealt to the sequences at random (slot tables as the
// engine builds them: padded with slot 0, bias -inf past each length).
struct PagedCase {
  at::Tensor q, kp, vp, slots, bias, lens;
};

PagedCase paged_case(std::int64_t B, std::int64_t nh, std::int64_t nkv, std::int64_t hd,
                     const std::vector<std::int64_t>& lens) {
  std::int64_t total = 0, Lmax = 0;
  for (auto n : lens) {
    total += n;
    Lmax = std::max(Lmax, n);
  }
  PagedCase c;
  const std::int64_t n_slots = total + 17;
  c.q = at::randn({B, nh, hd});
  c.kp = at::randn({n_slots, nkv, hd});
  c.vp = at::randn({n_slots, nkv, hd});
  auto perm = at::randperm(n_slots, at::TensorOptions().dtype(at::kLong));
  c.slots = at::zeros({B, std::max<std::int64_t>(Lmax, 1)}, at::TensorOptions().dtype(at::kLong));
  c.bias = at::full({B, c.slots.size(1)}, -std::numeric_limits<float>::infinity());
  std::int64_t next = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    const auto n = lens[static_cast<std::size_t>(b)];
    c.slots[b].narrow(0, 0, n).copy_(perm.narrow(0, next, n));
    c.bias[b].narrow(0, 0, n).zero_();
    next += n;
  }
  c.lens = at::tensor(lens, at::TensorOptions().dtype(at::kLong));
  return c;
}

TEST(Gpu, PagedDecodeKernelMatchesTheReference) {
  REQUIRE_GPU();
  if (!have_cuda_kernels()) GTEST_SKIP() << "this build has no CUDA kernels (cuda preset)";
  at::manual_seed(11);
  struct Shape {
    std::int64_t B, nh, nkv, hd;
    std::vector<std::int64_t> lens;
  };
  std::vector<Shape> shapes = {
      {1, 12, 2, 128, {3000}},                 // the 1.5B shape at batch 1: the keys split over SMs
      {1, 12, 2, 128, {1}},                    // the first decode step of a one-token prompt
      {5, 12, 2, 128, {7, 300, 1, 129, 64}},   // ragged, one chunk and several
      {3, 4, 2, 16, {5, 40, 2}},               // the tiny preset's heads
      {4, 14, 2, 64, {1000, 17, 513, 256}},    // 0.5B heads (g = 7)
      {2, 16, 2, 256, {100, 1300}},            // hd 256, g 8 (the kernel's limits)
  };
  std::vector<std::int64_t> lens64;
  for (int b = 0; b < 64; ++b) lens64.push_back(1 + (b * 37) % 700);
  shapes.push_back({64, 12, 2, 128, lens64});
  for (const auto& sh : shapes) {
    auto c = paged_case(sh.B, sh.nh, sh.nkv, sh.hd, sh.lens);
    for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      // The reference in fp32 on the CPU, from the inputs rounded to dt as the kernel sees them.
      auto r = [&](const at::Tensor& t) { return t.to(dt).to(at::kFloat); };
      auto want = paged_decode_attention_reference(r(c.q), r(c.kp), r(c.vp), c.slots, c.bias);
      auto dev = at::Device(at::kCUDA, 0);
      auto got = paged_decode_attention(c.q.to(dt).to(dev), c.kp.to(dt).to(dev), c.vp.to(dt).to(dev),
                                        c.slots.to(dev), c.bias.to(dev), c.lens.to(dev));
      ASSERT_EQ(got.scalar_type(), dt);
      const double diff = max_abs_diff(got, want);
      // fp32: reassociated sums and __expf; 16-bit: the output rounded once (|out| <~ 3).
      const double tol = dt == at::kFloat ? 2e-5 : (dt == at::kBFloat16 ? 2e-2 : 3e-3);
      EXPECT_LE(diff, tol) << c10::toString(dt) << " B=" << sh.B << " nh=" << sh.nh << " hd=" << sh.hd;
      std::printf("gpu: paged decode attention %s B=%lld nh=%lld nkv=%lld hd=%lld max |diff| %.3g\n",
                  c10::toString(dt), static_cast<long long>(sh.B), static_cast<long long>(sh.nh),
                  static_cast<long long>(sh.nkv), static_cast<long long>(sh.hd), diff);
    }
  }
  // Time against the gathered reference on the device: the 1.5B heads in bf16, batch 64 and 1.
  for (auto [B, L] : {std::pair<std::int64_t, std::int64_t>{64, 1024}, {1, 4096}}) {
    auto c = paged_case(B, 12, 2, 128, std::vector<std::int64_t>(static_cast<std::size_t>(B), L));
    auto dev = at::Device(at::kCUDA, 0);
    auto q = c.q.to(at::kBFloat16).to(dev), kp = c.kp.to(at::kBFloat16).to(dev), vp = c.vp.to(at::kBFloat16).to(dev);
    auto slots = c.slots.to(dev), bias = c.bias.to(dev), lens = c.lens.to(dev);
    using clk = std::chrono::steady_clock;
    auto time_of = [&](const std::function<at::Tensor()>& f) {
      (void)f().sum().item<float>();
      const auto t0 = clk::now();
      at::Tensor last;
      for (int k = 0; k < 50; ++k) last = f();
      (void)last.sum().item<float>();  // waits for the stream
      return std::chrono::duration<double>(clk::now() - t0).count() / 50;
    };
    const double ours = time_of([&] { return paged_decode_attention(q, kp, vp, slots, bias, lens); });
    const double ref = time_of([&] { return paged_decode_attention_reference(q, kp, vp, slots, bias); });
    const double gb = static_cast<double>(B * L) * 2 * 2 * 128 * 2 / 1e9;  // K and V read once
    std::printf("gpu: paged decode attention bf16 B=%lld L=%lld (1.5B heads): kernel %.1f us (%.0f GB/s of K/V), "
                "gathered reference %.1f us (%.1fx)\n",
                static_cast<long long>(B), static_cast<long long>(L), ours * 1e6, gb / ours, ref * 1e6, ref / ours);
  }
}

TEST(Gpu, BatchedLoraKernelMatchesThePerAdapterPath) {
  REQUIRE_GPU();
  if (!have_cuda_kernels()) GTEST_SKIP() << "this build has no CUDA kernels (cuda preset)";
  // Five adapters of the 1.5B shape's q and gate projections (ranks 8, 8, 16, 8 and 64; the fourth
  // targets attention only), rows dealt round-robin with some on the base model, in fp32 masters
  // against bf16 and fp32 activations.
  ModelConfig c = ModelConfig::preset("qwen2.5-1.5b-shape");
  c.num_hidden_layers = 1;
  std::vector<LoraAdapter> ads;
  const std::vector<std::int64_t> ranks = {8, 8, 16, 8, 64};
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    LoraConfig lc;
    lc.rank = ranks[i];
    lc.alpha = 2 * ranks[i];
    lc.targets = LoraConfig::parse_targets({i == 3 ? "q_proj" : "all-linear"});
    ads.push_back(LoraAdapter::init(lc, c, 20 + i, at::kCPU));
    for (auto m : lc.targets) ads.back().B(0, m).normal_(0, 0.05);
  }
  const auto dev = at::Device(at::kCUDA, 0);
  std::vector<LoraAdapter> on_dev;
  for (const auto& a : ads) on_dev.push_back(a.to(dev));
  at::NoGradGuard ng;
  for (std::int64_t T : {1, 7, 64, 300}) {
    std::vector<int> slot_of_row;
    for (std::int64_t r = 0; r < T; ++r) slot_of_row.push_back(r % 7 == 6 ? -1 : static_cast<int>(r % 5));
    std::vector<const LoraAdapter*> cpu_ptrs, dev_ptrs;
    for (std::size_t i = 0; i < ads.size(); ++i) {
      cpu_ptrs.push_back(&ads[i]);
      dev_ptrs.push_back(&on_dev[i]);
    }
    auto want_batch = LoraBatch::from_row_slots(cpu_ptrs, slot_of_row, at::kCPU);
    auto got_batch = LoraBatch::from_row_slots(dev_ptrs, slot_of_row, dev);
    ASSERT_TRUE(got_batch.batched_kernel());
    for (auto [m, in, out] : {std::tuple{LoraModule::kQ, c.hidden_size, c.q_dim()},
                              std::tuple{LoraModule::kGate, c.hidden_size, c.intermediate_size}}) {
      for (auto dt : {at::kFloat, at::kBFloat16}) {
        auto x = at::randn({T, in}).to(dt);
        auto y = at::randn({T, out}).to(dt);
        auto want = want_batch.apply(x.to(at::kFloat), y.to(at::kFloat), 0, m);
        auto got = got_batch.apply(x.to(dev), y.to(dev), 0, m);
        const double diff = max_abs_diff(got, want);
        const double scale = (want - y.to(at::kFloat)).abs().max().item<double>();
        // fp32: reassociated sums; bf16: y (|y| <~ 5) rounded once after the fp32 update.
        EXPECT_LE(diff, dt == at::kFloat ? 1e-4 : 4e-2) << c10::toString(dt) << " T=" << T << " module "
                                                        << static_cast<int>(m);
        std::printf("gpu: batched LoRA %s T=%lld %s max |diff| %.3g (max |delta| %.3g)\n", c10::toString(dt),
                    static_cast<long long>(T), m == LoraModule::kQ ? "q" : "gate", diff, scale);
      }
    }
  }
  // Time one projection (gate, 1536 -> 8960) at decode batch 64 in bf16: one launch against the
  // per-adapter gather / matmuls / scatter.
  std::vector<int> slot_of_row;
  for (int r = 0; r < 64; ++r) slot_of_row.push_back(r % 5);
  std::vector<const LoraAdapter*> dev_ptrs;
  for (auto& a : on_dev) dev_ptrs.push_back(&a);
  auto x = at::randn({64, c.hidden_size}).to(at::kBFloat16).to(dev);
  auto y = at::randn({64, c.intermediate_size}).to(at::kBFloat16).to(dev);
  using clk = std::chrono::steady_clock;
  auto time_of = [&](const LoraBatch& lb) {
    (void)lb.apply(x, y.clone(), 0, LoraModule::kGate).sum().item<float>();
    const auto t0 = clk::now();
    at::Tensor last;
    for (int k = 0; k < 50; ++k) last = lb.apply(x, y.clone(), 0, LoraModule::kGate);
    (void)last.sum().item<float>();
    return std::chrono::duration<double>(clk::now() - t0).count() / 50;
  };
  auto fused = LoraBatch::from_row_slots(dev_ptrs, slot_of_row, dev);
  const bool prev = set_batched_lora_kernel(false);
  auto unfused = LoraBatch::from_row_slots(dev_ptrs, slot_of_row, dev);
  set_batched_lora_kernel(prev);
  ASSERT_TRUE(fused.batched_kernel());
  ASSERT_FALSE(unfused.batched_kernel());
  const double tf = time_of(fused), tu = time_of(unfused);
  std::printf("gpu: batched LoRA bf16 64 rows, 5 adapters, gate 1536->8960: one launch %.1f us, per adapter %.1f us "
              "(%.1fx)\n", tf * 1e6, tu * 1e6, tu / tf);
}

TEST(Gpu, MixedAdapterDecodeOnCudaMatchesTheCpu) {
  REQUIRE_GPU();
  // A whole model with a KV cache: prompts of three sequences on two adapters and the base model,
  // then decode steps batched (the paged decode attention and the batched LoRA kernel where the
  // build has them) against the same on the CPU.
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 2048;
  auto w = random_weights(c, 4, at::kFloat, 0.1);
  LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  std::vector<LoraAdapter> ads;
  for (int i = 0; i < 2; ++i) {
    ads.push_back(LoraAdapter::init(lc, c, 30 + static_cast<std::uint64_t>(i), at::kCPU));
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l)
      for (auto m : lc.targets) ads.back().B(l, m).normal_(0, 0.2);
  }
  const auto dev = at::Device(at::kCUDA, 0);
  std::vector<LoraAdapter> on_dev = {ads[0].to(dev), ads[1].to(dev)};
  std::vector<std::vector<std::int64_t>> prompts = {{1, 2, 3, 4, 5}, {9, 8, 7, 100, 1000, 5, 6, 7, 8}, {42, 43}};
  const std::vector<int> slot_of_seq = {0, -1, 1};
  at::NoGradGuard ng;
  auto run = [&](c10::Device d, at::ScalarType dt, std::vector<const LoraAdapter*> ptrs) {
    auto m = DecoderModel::from_named(c, w, dt, d);
    ContiguousKvCache cache(c, 3, 64, dt, d);
    std::vector<int> rows;
    for (std::size_t i = 0; i < prompts.size(); ++i) rows.insert(rows.end(), prompts[i].size(), slot_of_seq[i]);
    auto pb = make_batch(prompts, {}, d);
    auto pm = cache.plan(pb.segs, {0, 1, 2});
    auto lb = LoraBatch::from_row_slots(ptrs, rows, d);
    std::vector<at::Tensor> logits = {m->logits(m->forward(pb, &lb, &cache.pool(), &pm)).to(at::kFloat).cpu()};
    std::vector<std::int64_t> lens = {5, 9, 2};
    for (int step = 0; step < 4; ++step) {
      auto db = make_batch({{11 + step}, {12 + step}, {13 + step}}, lens, d);
      auto dm = cache.plan(db.segs, {0, 1, 2});
      auto dl = LoraBatch::from_row_slots(ptrs, {slot_of_seq[0], slot_of_seq[1], slot_of_seq[2]}, d);
      logits.push_back(m->logits(m->forward(db, &dl, &cache.pool(), &dm)).to(at::kFloat).cpu());
      for (auto& n : lens) ++n;
    }
    return at::cat(logits, 0);
  };
  auto want = run(at::kCPU, at::kFloat, {&ads[0], &ads[1]});
  const double scale = want.abs().max().item<double>();
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    auto got = run(dev, dt, {&on_dev[0], &on_dev[1]});
    const double diff = max_abs_diff(got, want);
    EXPECT_LE(diff, dt == at::kFloat ? 1e-4 : 0.05 * scale) << c10::toString(dt);
    std::printf("gpu: mixed-adapter decode with a KV cache %s logits max |diff| %.3g (max |logit| %.3g)\n",
                c10::toString(dt), diff, scale);
  }
}

TEST(Gpu, ModelLogitsOnCudaMatchTheCpu) {
  REQUIRE_GPU();
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 2048;
  auto w = random_weights(c, 3, at::kFloat, 0.1);
  auto cpu = DecoderModel::from_named(c, w, at::kFloat, at::kCPU);
  LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  auto ad_cpu = LoraAdapter::init(lc, c, 5, at::kCPU);
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l)
    for (auto m : lc.targets) ad_cpu.B(l, m).normal_(0, 0.2);
  std::vector<std::vector<std::int64_t>> seqs = {{1, 2, 3, 4, 5, 6, 7}, {9, 8, 7, 100, 1000}};
  at::NoGradGuard ng;
  for (bool with_lora : {false, true}) {
    auto lb = LoraBatch::all(with_lora ? &ad_cpu : nullptr);
    auto want = cpu->logits(cpu->forward(make_batch(seqs, {}, at::kCPU), &lb));
    for (auto dt : {at::kFloat, at::kBFloat16}) {
      auto gpu = DecoderModel::from_named(c, w, dt, at::Device(at::kCUDA, 0));
      auto ad = ad_cpu.to(at::Device(at::kCUDA, 0));
      auto lg = LoraBatch::all(with_lora ? &ad : nullptr);
      auto got = gpu->logits(gpu->forward(make_batch(seqs, {}, gpu->device()), &lg));
      const double diff = max_abs_diff(got, want);
      const double scale = want.abs().max().item<double>();
      EXPECT_LE(diff, dt == at::kFloat ? 1e-4 : 0.05 * scale) << c10::toString(dt) << " lora=" << with_lora;
      std::printf("gpu: tiny model %s lora=%d logits max |diff| %.3g (max |logit| %.3g)\n",
                  c10::toString(dt), with_lora ? 1 : 0, diff, scale);
    }
  }
}

TEST(Gpu, DecodeGraphReplaysEqualEagerStepsAndAreTimed) {
  REQUIRE_GPU();
  if (!have_cuda_kernels()) GTEST_SKIP() << "decode graphs need our CUDA kernels (cuda preset)";
  // Two DecodeGraphs on identical pools, one capturing and replaying, one eager on the same static
  // buffers: steps of 5, 3, 1 and 8 rows on two adapters and the base model, the logits compared
  // step by step (the graphs' first step of each bucket is its warm-up, later ones replays); then
  // a new adapter in a slot, which must need no capture.
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 2048;
  auto w = random_weights(c, 5, at::kFloat, 0.1);
  const auto dev = at::Device(at::kCUDA, 0);
  LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    auto m = DecoderModel::from_named(c, w, dt, dev);
    AdapterSet ads;
    for (int i = 0; i < 2; ++i) {
      auto a = LoraAdapter::init(lc, c, 60 + static_cast<std::uint64_t>(i), at::kCPU);
      for (std::int64_t l = 0; l < c.num_hidden_layers; ++l)
        for (auto mod : lc.targets) a.B(l, mod).normal_(0, 0.2);
      ads.push_back(std::make_shared<const LoraAdapter>(a.to(dev)));
    }
    const std::int64_t n = 8, cap = 64;
    KvPool pg = KvPool::allocate(c, n * cap + 1, dt, dev), pe = KvPool::allocate(c, n * cap + 1, dt, dev);
    for (std::size_t l = 0; l < pg.k.size(); ++l) {
      pg.k[l].zero_(), pg.v[l].zero_(), pe.k[l].zero_(), pe.v[l].zero_();
    }
    DecodeGraphs::Options o;
    o.buckets = {1, 4, 8};
    o.max_context = cap;
    o.scratch_slot = n * cap;
    o.lora_slots = 2;
    o.lora_rank = 8;
    DecodeGraphs graphs(*m, pg, o);
    o.capture = false;
    DecodeGraphs eager(*m, pe, o);
    ASSERT_TRUE(graphs.capturing());
    std::vector<std::int64_t> lens(static_cast<std::size_t>(n), 0);
    const std::vector<std::int64_t> sizes = {5, 5, 3, 1, 8, 3, 8, 1, 5};
    double worst = 0;
    for (std::size_t st = 0; st < sizes.size(); ++st) {
      DecodeStep ds;
      for (std::int64_t i = 0; i < sizes[st]; ++i) {
        const auto k = static_cast<std::size_t>(i);
        ds.tokens.push_back((i * 131 + static_cast<std::int64_t>(st) * 17) % c.vocab_size);
        ds.positions.push_back(lens[k]);
        ds.slot_mapping.push_back(i * cap + lens[k]);
        ds.lens.push_back(lens[k] + 1);
        for (std::int64_t p = 0; p <= lens[k]; ++p) ds.context.push_back(i * cap + p);
        ds.adapter_slot.push_back(static_cast<int>(i % 3) - 1);  // base, adapter 0, adapter 1
        ++lens[k];
      }
      auto want = eager.run(ds, ads).clone();
      auto got = graphs.run(ds, ads).clone();
      const double diff = max_abs_diff(got, want);
      worst = std::max(worst, diff);
      EXPECT_LE(diff, dt == at::kFloat ? 1e-4 : 0.05 * want.abs().max().item<double>()) << "step " << st;
    }
    EXPECT_EQ(graphs.stats().captures, 3);
    EXPECT_EQ(graphs.stats().replays, static_cast<std::int64_t>(sizes.size()) - 3);
    std::printf("gpu: decode graphs %s: %lld captures (%.1f ms in all), %lld replays, max |logit diff| vs eager %.3g\n",
                c10::toString(dt), static_cast<long long>(graphs.stats().captures),
                1e3 * graphs.stats().capture_seconds, static_cast<long long>(graphs.stats().replays), worst);
    // A new adapter in slot 1 is copied into the slot's weights: the next steps replay the same
    // graphs (no capture) and still equal the eager steps.
    auto a3 = LoraAdapter::init(lc, c, 77, at::kCPU);
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l)
      for (auto mod : lc.targets) a3.B(l, mod).normal_(0, 0.2);
    AdapterSet swapped = {ads[0], std::make_shared<const LoraAdapter>(a3.to(dev))};
    const auto before = graphs.stats().captures;
    for (std::int64_t rows : {5, 1}) {
      DecodeStep ds;
      for (std::int64_t i = 0; i < rows; ++i) {
        const auto k = static_cast<std::size_t>(i);
        ds.tokens.push_back((i * 7 + 3) % c.vocab_size);
        ds.positions.push_back(lens[k]);
        ds.slot_mapping.push_back(i * cap + lens[k]);
        ds.lens.push_back(lens[k] + 1);
        for (std::int64_t p = 0; p <= lens[k]; ++p) ds.context.push_back(i * cap + p);
        ds.adapter_slot.push_back(static_cast<int>(i % 2));
        ++lens[k];
      }
      auto want = eager.run(ds, swapped).clone();
      auto got = graphs.run(ds, swapped).clone();
      EXPECT_LE(max_abs_diff(got, want), dt == at::kFloat ? 1e-4 : 0.05 * want.abs().max().item<double>())
          << "after the adapter change, " << rows << " rows";
    }
    EXPECT_EQ(graphs.stats().captures, before);
  }
}

}  // namespace
}  // namespace lorasync::model
