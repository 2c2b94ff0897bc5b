// Our CPU decode kernels against the libtorch expressions of the same maths, on the AVX-512, AVX2
// and portable implementations (those the CPU has), and the model's fast decode path against its
// libtorch path.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <filesystem>
#include <iostream>
#include <random>
#include <thread>

#include "core/model/cpu_kernels.h"
#include "core/model/device_kernels.h"
#include "core/model/decoder_model.h"
#include "core/model/runtime.h"
#include "util/error.h"

namespace lorasync::model {
namespace {

double max_rel_diff(const at::Tensor& got, const at::Tensor& want) {
  auto g = got.to(at::kDouble), w = want.to(at::kDouble);
  return ((g - w).abs() / (w.abs() + 1.0)).max().item<double>();
}

// Runs `body` with the AVX-512 kernels (where the CPU has them), the AVX2 ones (where it has
// them) and the portable ones.
template <class F>
void both_isas(F body) {
  for (int isa : {0, 1, 2}) {
    const bool prev = cpu::set_force_portable(isa == 2);
    const bool prev512 = cpu::set_avx512_allowed(isa == 0);
    if (isa != 0 || cpu::avx512_in_use()) {
      SCOPED_TRACE(isa == 2 ? "portable kernels" : isa == 1 ? "AVX2 kernels (if the CPU has them)" : "AVX-512 kernels");
      body();
    }
    cpu::set_force_portable(prev);
    cpu::set_avx512_allowed(prev512);
  }
}

TEST(CpuKernels, LinearEqualsAtLinearForEveryRowCountAndTail) {
  at::manual_seed(1);
  both_isas([] {
    for (std::int64_t M : {1, 2, 3, 5, 8, 15, 16, 17, 33, 70})
      for (std::int64_t K : {8, 13, 64, 100})
        for (std::int64_t N : {1, 3, 4, 7, 9, 70}) {
          auto x = at::randn({M, K});
          auto w = at::randn({N, K});
          auto b = at::randn({N});
          auto y = at::full({M, N}, std::nanf(""));
          cpu::LinearOut part{w.data_ptr<float>(), b.data_ptr<float>(), N, y.data_ptr<float>(), N};
          cpu::linear(x.data_ptr<float>(), M, K, K, std::span<const cpu::LinearOut>(&part, 1));
          EXPECT_LE(max_rel_diff(y, at::linear(x, w, b)), 1e-5) << "M=" << M << " K=" << K << " N=" << N;
        }
  });
}

TEST(CpuKernels, PartsSharingOneInputWriteStridedOutputs) {
  at::manual_seed(2);
  both_isas([] {
    const std::int64_t M = 3, K = 40;
    auto x = at::randn({M, K});
    auto wq = at::randn({24, K}), wk = at::randn({8, K}), bq = at::randn({24});
    // Both outputs land in one [M, 32] buffer (row stride 32).
    auto y = at::zeros({M, 32});
    cpu::LinearOut parts[] = {{wq.data_ptr<float>(), bq.data_ptr<float>(), 24, y.data_ptr<float>(), 32},
                              {wk.data_ptr<float>(), nullptr, 8, y.data_ptr<float>() + 24, 32}};
    cpu::linear(x.data_ptr<float>(), M, K, K, parts);
    EXPECT_LE(max_rel_diff(y.narrow(1, 0, 24), at::linear(x, wq, bq)), 1e-5);
    EXPECT_LE(max_rel_diff(y.narrow(1, 24, 8), at::linear(x, wk)), 1e-5);
  });
}

// The outer-product kernel on its own, at row counts below and above its panel (16), two-panel
// (32, the AVX-512 tile), block (64) and pass (512) sizes, weight-row tails of every tile size (6 with AVX2,
// 12 with AVX-512), K from 1, bias on and off, and strided inputs and outputs shared by two
// parts. Where the CPU has AVX-512 both tiles run and give the same bits (each output is one
// lane's sum over k in order in both). Without AVX2 it runs linear_rows; the test says so.
TEST(CpuKernels, GemmKernelEqualsAtLinearAcrossPanelsTilesAndBlocks) {
  if (!cpu::linear_gemm_available()) std::cerr << "no AVX2+FMA: linear_gemm runs the row kernels\n";
  const bool prev = cpu::set_avx512_allowed(true);
  const bool has512 = cpu::avx512_in_use();
  if (!has512) std::cerr << "no AVX-512F: only the AVX2 tiles run\n";
  at::manual_seed(3);
  for (std::int64_t M : {1, 7, 16, 17, 32, 40, 48, 64, 65, 130, 1100})  // 1100: three passes of 512 rows
    for (std::int64_t K : {1, 7, 64, 129})
      for (std::int64_t N : {1, 5, 6, 7, 11, 12, 13, 25, 71})
        for (bool with_bias : {false, true}) {
          auto x = at::randn({M, K + 3}).narrow(1, 0, K);  // row stride K + 3
          auto w = at::randn({N, K});
          auto b = at::randn({N});
          auto w2 = at::randn({4, K});
          at::Tensor first;
          for (bool avx512 : {true, false}) {
            if (avx512 && !has512) continue;
            cpu::set_avx512_allowed(avx512);
            auto y = at::full({M, N + 4 + 2}, std::nanf(""));  // both parts in one buffer, stride N + 6
            cpu::LinearOut parts[] = {
                {w.data_ptr<float>(), with_bias ? b.data_ptr<float>() : nullptr, N, y.data_ptr<float>(), N + 6},
                {w2.data_ptr<float>(), nullptr, 4, y.data_ptr<float>() + N, N + 6}};
            cpu::linear_gemm(x.data_ptr<float>(), M, K, K + 3, parts);
            SCOPED_TRACE(avx512 ? "AVX-512 tiles" : "AVX2 tiles");
            auto want = with_bias ? at::linear(x, w, b) : at::linear(x, w);
            EXPECT_LE(max_rel_diff(y.narrow(1, 0, N), want), 1e-5) << "M=" << M << " K=" << K << " N=" << N;
            EXPECT_LE(max_rel_diff(y.narrow(1, N, 4), at::linear(x, w2)), 1e-5) << "M=" << M << " K=" << K;
            // The two columns past the parts are never written.
            EXPECT_TRUE(y.narrow(1, N + 4, 2).isnan().all().item<bool>()) << "M=" << M << " K=" << K << " N=" << N;
            if (!first.defined()) first = y;
            else EXPECT_TRUE(at::equal(first.narrow(1, 0, N + 4), y.narrow(1, 0, N + 4))) << "M=" << M << " K=" << K << " N=" << N;
          }
        }
  cpu::set_avx512_allowed(prev);
}

// The LoRA deltas of three adapters on two outputs, each adapter on its own scattered rows (one
// on every row of a second batch), ranks 1 to 16, outputs past the 256-output block, both ISAs:
// equal to y + s * (x[rows] A^T) B^T added at the rows.
TEST(CpuKernels, LoraDeltasEqualTheLowRankProductsAtTheirRows) {
  at::manual_seed(4);
  both_isas([] {
    const std::int64_t M = 23, in = 37;
    auto x = at::randn({M, in + 2}).narrow(1, 0, in);  // row stride in + 2
    const std::int64_t outs[2] = {300, 5};
    // 13 rows (the gathered outer-product path for A; B transposed, four rows at a time and a
    // tail), 3 and 1 (the per-row-block tasks; B read in place at rank 16, transposed at rank 1).
    std::vector<std::vector<std::int64_t>> rows = {{0, 4, 5, 9, 10, 11, 12, 13, 14, 15, 16, 20, 22}, {1, 2, 21}, {3}};
    const std::int64_t ranks[3] = {8, 1, 16};
    const float scales[3] = {2.0f, 0.5f, 1.25f};
    std::vector<at::Tensor> As, Bs, ys, want;
    for (int o = 0; o < 2; ++o) {
      ys.push_back(at::randn({M, outs[o]}));
      want.push_back(ys.back().clone());
    }
    std::vector<cpu::LoraDelta> ds;
    for (int a = 0; a < 3; ++a)
      for (int o = 0; o < 2; ++o) {
        As.push_back(at::randn({ranks[a], in}) * 0.25);
        Bs.push_back(at::randn({outs[o], ranks[a]}) * 0.25);
        auto idx = at::tensor(rows[static_cast<std::size_t>(a)], at::kLong);
        want[static_cast<std::size_t>(o)].index_add_(
            0, idx, at::linear(at::linear(x.index_select(0, idx), As.back()), Bs.back()) * scales[a]);
        ds.push_back({As.back().data_ptr<float>(), Bs.back().data_ptr<float>(), ranks[a], scales[a],
                      rows[static_cast<std::size_t>(a)].data(), static_cast<std::int64_t>(rows[static_cast<std::size_t>(a)].size()),
                      ys[static_cast<std::size_t>(o)].data_ptr<float>(), outs[o], outs[o]});
      }
    cpu::lora_deltas(x.data_ptr<float>(), in + 2, in, ds);
    for (int o = 0; o < 2; ++o) EXPECT_LE(max_rel_diff(ys[static_cast<std::size_t>(o)], want[static_cast<std::size_t>(o)]), 1e-5) << "output " << o;
    // One adapter on every row (rows null).
    auto y = at::randn({M, 40});
    auto A = at::randn({4, in}), B = at::randn({40, 4});
    auto w = y + at::linear(at::linear(x, A), B) * 3.0;
    cpu::LoraDelta all{A.data_ptr<float>(), B.data_ptr<float>(), 4, 3.0f, nullptr, M, y.data_ptr<float>(), 40, 40};
    cpu::lora_deltas(x.data_ptr<float>(), in + 2, in, std::span<const cpu::LoraDelta>(&all, 1));
    EXPECT_LE(max_rel_diff(y, w), 1e-5);
  });
}

// The B half of a LoRA delta, A x given: serially (a decode step's size) and in one parallel
// region (past kLoraSerialMacs), ranks on the eight-wide path and off it, rows listed and all rows.
TEST(CpuKernels, LoraBUpdatesAddTheScaledProductsAtTheirRows) {
  at::manual_seed(5);
  both_isas([] {
    for (const std::int64_t out : {std::int64_t{37}, std::int64_t{3000}}) {  // serial, then a region
      const std::int64_t M = 40, width = 8 + 3 + 16;
      auto t = at::randn({M, width});
      auto y = at::randn({M, out});
      auto want = y.clone();
      const std::int64_t ranks[3] = {8, 3, 16}, offs[3] = {0, 8, 11};
      const float scales[3] = {2.0f, 0.5f, 1.25f};
      std::vector<std::vector<std::int64_t>> rows = {{0, 5, 9, 39}, {1, 2, 17}, {}};
      std::vector<at::Tensor> Bs;
      std::vector<cpu::LoraBUpdate> ups;
      for (int a = 0; a < 3; ++a) {
        Bs.push_back(at::randn({out, ranks[a]}) * 0.25);
        auto ta = t.narrow(1, offs[a], ranks[a]);
        const bool all = rows[static_cast<std::size_t>(a)].empty();
        if (all) {
          // every row: only on the rows the others leave (updates must not share an element)
          for (std::int64_t i = 20; i < M; ++i) rows[static_cast<std::size_t>(a)].push_back(i);
        }
        auto idx = at::tensor(rows[static_cast<std::size_t>(a)], at::kLong);
        want.index_add_(0, idx, at::linear(ta.index_select(0, idx), Bs.back()) * scales[a]);
        ups.push_back({t.data_ptr<float>() + offs[a], width, Bs.back().data_ptr<float>(), ranks[a], scales[a],
                       rows[static_cast<std::size_t>(a)].data(), static_cast<std::int64_t>(rows[static_cast<std::size_t>(a)].size()),
                       y.data_ptr<float>(), out, out});
      }
      std::int64_t macs = 0;
      for (const auto& u : ups) macs += u.n_rows * u.out * u.r;
      EXPECT_EQ(macs >= cpu::kLoraSerialMacs, out == 3000);
      cpu::lora_b_updates(ups);
      EXPECT_LE(max_rel_diff(y, want), 1e-5) << "out " << out;
    }
    // rows null: rows 0 .. n_rows - 1.
    auto t = at::randn({6, 8}), B = at::randn({10, 8}), y = at::randn({6, 10});
    auto want = y + at::linear(t, B) * 0.75;
    cpu::LoraBUpdate u{t.data_ptr<float>(), 8, B.data_ptr<float>(), 8, 0.75f, nullptr, 6, y.data_ptr<float>(), 10, 10};
    cpu::lora_b_updates(std::span<const cpu::LoraBUpdate>(&u, 1));
    EXPECT_LE(max_rel_diff(y, want), 1e-5);
  });
}

// parallel_for_cost visits every index once, in pieces cut by cost, whatever the costs (zeros,
// one huge task, fewer tasks than threads).
TEST(CpuKernels, CostBalancedPiecesCoverEveryIndexOnce) {
  const std::vector<std::vector<std::int64_t>> cases = {
      {5, 5, 5, 5}, {100, 1, 1, 1, 1, 1}, {0, 0, 7, 0, 0}, {1}, {}, {0, 0, 0}, {3, 64, 64, 8, 8, 8, 8, 64, 16}};
  for (const auto& costs : cases) {
    std::vector<std::atomic<int>> seen(costs.size());
    cpu::parallel_for_cost(
        static_cast<std::int64_t>(costs.size()), [&](std::int64_t i) { return costs[static_cast<std::size_t>(i)]; },
        [&](std::int64_t b, std::int64_t e) {
          for (std::int64_t i = b; i < e; ++i) seen[static_cast<std::size_t>(i)]++;
        });
    for (std::size_t i = 0; i < costs.size(); ++i) EXPECT_EQ(seen[i].load(), 1) << "task " << i << " of " << costs.size();
  }
}

TEST(CpuKernels, NormRopeAndSiluEqualTheReferences) {
  at::manual_seed(3);
  const std::int64_t M = 4, heads = 3, hd = 16;
  auto x = at::randn({M, heads * hd}) * 3.0;
  auto w = at::randn({heads * hd});
  auto got = at::empty_like(x);
  cpu::rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), 1e-6f, M, heads * hd, got.data_ptr<float>());
  EXPECT_LE(max_rel_diff(got, rms_norm_reference(x, w, 1e-6)), 1e-6);

  auto inv = rope_inv_freq(hd, 10000.0, at::kCPU);
  std::vector<std::int64_t> pos = {0, 7, 300, 4095};
  auto p = at::tensor(pos, at::TensorOptions().dtype(at::kLong));
  auto [c, s] = rope_cos_sin(p, inv);
  auto want = apply_rope(x.view({M, heads, hd}), c, s).reshape({M, heads * hd});
  auto r = x.clone();
  cpu::rope(r.data_ptr<float>(), M, heads * hd, heads, hd, pos.data(), inv.data_ptr<float>());
  EXPECT_LE(max_rel_diff(r, want), 1e-5);

  auto up = at::randn({M, heads * hd});
  both_isas([&] {
    auto act = at::empty_like(x);
    cpu::silu_mul(x.data_ptr<float>(), up.data_ptr<float>(), x.numel(), act.data_ptr<float>());
    EXPECT_LE(max_rel_diff(act, at::silu(x) * up), 1e-6);
  });
}

// Steps large enough to split their rows over the threads give the same results.
TEST(CpuKernels, ElementwiseStepsSplitOverThreadsEqualTheReferences) {
  at::manual_seed(6);
  const std::int64_t M = 300, heads = 4, hd = 64, d = heads * hd;  // 76,800 elements per step
  auto x = at::randn({M, d}) * 2.0;
  auto w = at::randn({d});
  auto got = at::empty_like(x);
  cpu::rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), 1e-6f, M, d, got.data_ptr<float>());
  EXPECT_LE(max_rel_diff(got, rms_norm_reference(x, w, 1e-6)), 1e-6);
  auto inv = rope_inv_freq(hd, 10000.0, at::kCPU);
  std::vector<std::int64_t> pos(static_cast<std::size_t>(M));
  for (std::int64_t i = 0; i < M; ++i) pos[static_cast<std::size_t>(i)] = 3 * i;
  auto [c, s] = rope_cos_sin(at::tensor(pos, at::TensorOptions().dtype(at::kLong)), inv);
  auto r = x.clone();
  cpu::rope(r.data_ptr<float>(), M, d, heads, hd, pos.data(), inv.data_ptr<float>());
  EXPECT_LE(max_rel_diff(r, apply_rope(x.view({M, heads, hd}), c, s).reshape({M, d})), 1e-5);
  auto g = at::randn({5, 40001}) * 4.0, u = at::randn({5, 40001});  // odd length: a scalar tail
  auto act = at::empty_like(g);
  cpu::silu_mul(g.data_ptr<float>(), u.data_ptr<float>(), g.numel(), act.data_ptr<float>());
  EXPECT_LE(max_rel_diff(act, at::silu(g) * u), 1e-6);
}

// Head sizes of 12 (the portable loop inside the AVX2 build), 16, 64 and 128 (the 1.5B shape:
// two passes of 64 value dimensions), contexts from 1 to 150 keys (eight-key blocks and tails),
// slots scattered and reversed.
TEST(CpuKernels, DecodeAttentionReadsScatteredSlotsInPlace) {
  at::manual_seed(4);
  both_isas([] {
    for (std::int64_t hd : {12, 16, 64, 128}) {
      const std::int64_t nh = 6, nkv = 2, n_slots = 160;
      auto kp = at::randn({n_slots, nkv, hd}), vp = at::randn({n_slots, nkv, hd});
      std::mt19937 rng(9);
      std::vector<std::vector<std::int64_t>> slots = {{5}, {}, {}, {}, {}};
      for (int j = 0; j < 17; ++j) slots[1].push_back(static_cast<std::int64_t>(rng() % n_slots));
      for (int j = 0; j < 40; ++j) slots[2].push_back(n_slots - 1 - j);
      for (int j = 0; j < 8; ++j) slots[3].push_back(static_cast<std::int64_t>(rng() % n_slots));
      for (int j = 0; j < 150; ++j) slots[4].push_back(static_cast<std::int64_t>(rng() % n_slots));
      const auto B = static_cast<std::int64_t>(slots.size());
      auto q = at::randn({B, nh * hd});
      auto out = at::full({B, nh * hd}, std::nanf(""));
      std::vector<const std::int64_t*> ptrs;
      std::vector<std::int64_t> lens;
      for (auto& s : slots) {
        ptrs.push_back(s.data());
        lens.push_back(static_cast<std::int64_t>(s.size()));
      }
      cpu::decode_attention(q.data_ptr<float>(), kp.data_ptr<float>(), vp.data_ptr<float>(), nh, nkv, hd, B,
                            nullptr, ptrs.data(), lens.data(), out.data_ptr<float>());
      for (std::int64_t b = 0; b < B; ++b) {
        auto idx = at::tensor(slots[static_cast<std::size_t>(b)], at::TensorOptions().dtype(at::kLong));
        auto want = segment_attention_reference(q[b].view({1, nh, hd}), kp.index_select(0, idx),
                                                vp.index_select(0, idx), lens[static_cast<std::size_t>(b)] - 1);
        EXPECT_LE(max_rel_diff(out[b].view({1, -1}), want), 1e-5) << "hd " << hd << ", sequence " << b;
      }
    }
  });
}

// The prefill chunk's causal attention: every (length, cached context, heads, head size) mix,
// key blocks cut anywhere (64 keys) and query blocks too (16 tokens), strided rows, against the
// explicit softmax(QK^T/sqrt(hd))V; only the portable-forced build lacks the kernel (it says so).
TEST(CpuKernels, CausalAttentionEqualsTheExplicitSoftmaxForEveryChunkAndContext) {
  at::manual_seed(6);
  struct Shape {
    std::int64_t nh, nkv, hd;
  };
  int ran = 0;
  for (Shape sh : {Shape{8, 2, 64}, Shape{4, 4, 16}, Shape{12, 2, 128}, Shape{6, 1, 32}}) {
    if (!cpu::causal_attention_available(sh.hd)) continue;
    for (std::int64_t L : {1, 5, 16, 17, 63, 64, 65, 130}) {
      for (std::int64_t past : {0, 1, 40, 64, 100}) {
        const std::int64_t S = past + L, qd = sh.nh * sh.hd, kvd = sh.nkv * sh.hd;
        // Rows wider than the heads (a strided view of a larger buffer), as a fused projection has.
        auto qbuf = at::randn({L, qd + 24}) * 2.0, kbuf = at::randn({S, kvd + 8}) * 2.0, vbuf = at::randn({S, kvd + 8});
        auto q = qbuf.narrow(1, 0, qd).contiguous().view({L, sh.nh, sh.hd});
        auto k = kbuf.narrow(1, 0, kvd).contiguous().view({S, sh.nkv, sh.hd});
        auto v = vbuf.narrow(1, 0, kvd).contiguous().view({S, sh.nkv, sh.hd});
        auto want = segment_attention_reference(q, k, v, past);
        // With the AVX-512 tiles (where the CPU has them) and without: the same bits.
        at::Tensor first;
        for (bool avx512 : {true, false}) {
          const bool prev = cpu::set_avx512_allowed(avx512);
          if (avx512 && !cpu::avx512_in_use()) {
            cpu::set_avx512_allowed(prev);
            continue;
          }
          auto out = at::full({L, qd + 40}, std::nanf(""));
          cpu::causal_attention(qbuf.data_ptr<float>(), qd + 24, kbuf.data_ptr<float>(), vbuf.data_ptr<float>(),
                                kvd + 8, L, past, sh.nh, sh.nkv, sh.hd, out.data_ptr<float>(), qd + 40);
          cpu::set_avx512_allowed(prev);
          auto got = out.narrow(1, 0, qd);
          ASSERT_LE(max_rel_diff(got, want), 2e-5) << (avx512 ? "AVX-512 tiles" : "AVX2 tiles") << ": nh " << sh.nh
                                                   << ", nkv " << sh.nkv << ", hd " << sh.hd << ", L " << L
                                                   << ", past " << past;
          // Outside the rows' heads nothing was written.
          EXPECT_TRUE(out.narrow(1, qd, 40).isnan().all().item<bool>());
          if (!first.defined()) first = got.clone();
          else EXPECT_TRUE(at::equal(first, got)) << "nh " << sh.nh << ", hd " << sh.hd << ", L " << L << ", past " << past;
          ++ran;
        }
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "no AVX2 + FMA on this CPU: callers use libtorch's attention";
  // Large scores (a peaked softmax, the running max moving between key blocks) stay exact.
  const std::int64_t L = 100, past = 60, nh = 4, nkv = 2, hd = 64, S = past + L;
  auto q = at::randn({L, nh, hd}) * 6.0, k = at::randn({S, nkv, hd}) * 6.0, v = at::randn({S, nkv, hd});
  auto out = at::empty({L, nh * hd});
  cpu::causal_attention(q.data_ptr<float>(), nh * hd, k.data_ptr<float>(), v.data_ptr<float>(), nkv * hd, L, past, nh,
                        nkv, hd, out.data_ptr<float>(), nh * hd);
  EXPECT_LE(max_rel_diff(out, segment_attention_reference(q, k, v, past)), 2e-5);
}

// A step's chunks in one call (one parallel region): each equals its own call, whatever the mix of
// lengths and cached contexts, and the outputs of other rows are untouched.
TEST(CpuKernels, CausalAttentionOverManyChunksEqualsOneCallEach) {
  const std::int64_t nh = 8, nkv = 2, hd = 64, qd = nh * hd, kvd = nkv * hd;
  if (!cpu::causal_attention_available(hd)) GTEST_SKIP() << "no AVX2 + FMA on this CPU";
  at::manual_seed(7);
  const std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{64, 0}, {1, 0}, {17, 30}, {130, 0}, {5, 200}};
  std::int64_t rows = 0;
  for (auto [L, past] : shapes) rows += L;
  auto q = at::randn({rows, qd}), out = at::full({rows + 3, qd}, std::nanf("")), want = at::empty({rows, qd});
  std::vector<at::Tensor> ks, vs;
  std::vector<cpu::AttentionChunk> chunks;
  std::int64_t r = 0;
  for (auto [L, past] : shapes) {
    ks.push_back(at::randn({past + L, kvd}));
    vs.push_back(at::randn({past + L, kvd}));
    chunks.push_back({q.data_ptr<float>() + r * qd, ks.back().data_ptr<float>(), vs.back().data_ptr<float>(),
                      out.data_ptr<float>() + r * qd, L, past});
    cpu::causal_attention(q.data_ptr<float>() + r * qd, qd, ks.back().data_ptr<float>(), vs.back().data_ptr<float>(),
                          kvd, L, past, nh, nkv, hd, want.data_ptr<float>() + r * qd, qd);
    r += L;
  }
  cpu::causal_attention(chunks, qd, kvd, qd, nh, nkv, hd);
  EXPECT_TRUE(at::equal(out.narrow(0, 0, rows), want));
  EXPECT_TRUE(out.narrow(0, rows, 3).isnan().all().item<bool>());
}

TEST(CpuKernels, SoftmaxStatisticsMatchLogSoftmax) {
  at::manual_seed(5);
  both_isas([] {
    for (float t : {1.0f, 0.7f}) {
      auto x = at::randn({3001}) * 12.0;
      x[17] = -1e30f;  // far below e^-87 after the shift: exactly 0
      const float mx = cpu::row_max(x.data_ptr<float>(), x.numel(), t);
      EXPECT_FLOAT_EQ(mx, (x / t).max().item<float>());
      std::vector<float> e(3001);
      std::vector<double> sums(4);
      const double total = cpu::row_exp_blocks(x.data_ptr<float>(), x.numel(), t, mx, e.data(), sums.data(), 1024);
      EXPECT_EQ(e[17], 0.0f);
      auto want = at::log_softmax(x / t, 0).to(at::kDouble);
      double worst = 0;
      for (std::int64_t i = 0; i < x.numel(); ++i) {
        if (want[i].item<double>() < -80) continue;
        const double got = std::log(static_cast<double>(e[static_cast<std::size_t>(i)])) - std::log(total);
        worst = std::max(worst, std::abs(got - want[i].item<double>()));
      }
      EXPECT_LE(worst, 2e-5) << "t=" << t;
      EXPECT_NEAR(sums[0] + sums[1] + sums[2] + sums[3], total, 1e-9 * total);
    }
  });
}

ModelConfig tiny_config() {
  ModelConfig c = ModelConfig::preset("tiny");
  c.vocab_size = 1000;
  c.intermediate_size = 96;
  return c;
}

// An adapter on every linear with non-zero A and B, so that its deltas matter.
LoraAdapter busy_adapter(const ModelConfig& c, std::int64_t rank, std::uint64_t seed) {
  LoraConfig lc;
  lc.rank = rank;
  lc.alpha = 2.0 * static_cast<double>(rank);
  lc.targets = LoraConfig::parse_targets({"all-linear"});
  auto a = LoraAdapter::init(lc, c, seed, at::kCPU);
  for (auto& p : a.parameters()) p.normal_(0, 0.05);
  return a;
}

// The model's decode step on our kernels equals its libtorch path: single and batched decode,
// rows of two adapters and the base model in one batch, both kernel ISAs.
TEST(CpuDecode, FastPathEqualsLibtorchPathWithMixedAdapters) {
  const ModelConfig c = tiny_config();
  auto m = DecoderModel::from_named(c, random_weights(c, 1, at::kFloat, 0.1), at::kFloat, at::kCPU);
  auto a1 = busy_adapter(c, 4, 11), a2 = busy_adapter(c, 4, 12);
  at::NoGradGuard ng;
  std::mt19937 rng(7);
  auto run = [&](bool fast, bool batched) {
    const bool prev = set_cpu_fast_paths(fast);
    ContiguousKvCache cache(c, 3, 40, at::kFloat, at::kCPU);
    std::vector<std::vector<std::int64_t>> prompts = {{1, 2, 3}, {4, 5, 6, 7, 8, 9, 10, 11, 12}, {13, 14, 15, 16, 17}};
    auto pb = make_batch(prompts, {}, at::kCPU);
    auto pm = cache.plan(pb.segs, {0, 1, 2});
    m->forward(pb, nullptr, &cache.pool(), &pm);
    auto lora = LoraBatch::from_row_slots({&a1, &a2}, {0, -1, 1}, at::kCPU);
    std::vector<std::int64_t> past = {3, 9, 5};
    std::vector<at::Tensor> out;
    for (int step = 0; step < 6; ++step) {
      auto db = make_batch({{20 + step}, {30 + step}, {40 + step}}, past, at::kCPU);
      auto dm = cache.plan(db.segs, {0, 1, 2}, batched);
      out.push_back(m->logits(m->forward(db, &lora, &cache.pool(), &dm)));
      for (auto& p : past) ++p;
    }
    set_cpu_fast_paths(prev);
    return at::stack(out);
  };
  for (bool batched : {true, false}) {
    auto want = run(false, batched);
    both_isas([&] { EXPECT_LE(max_rel_diff(run(true, batched), want), 1e-5) << "batched=" << batched; });
  }
  // One sequence alone (the engine's B = 1 plan: context slots, no padded table).
  const bool prev = set_cpu_fast_paths(true);
  ContiguousKvCache cache(c, 1, 8, at::kFloat, at::kCPU);
  auto pb = make_batch({{1, 2, 3}}, {}, at::kCPU);
  auto pm = cache.plan(pb.segs, {0});
  m->forward(pb, nullptr, &cache.pool(), &pm);
  auto db = make_batch({{4}}, {3}, at::kCPU);
  auto dm = cache.plan(db.segs, {0});
  auto got = m->logits(m->forward(db, nullptr, &cache.pool(), &dm));
  auto full = m->logits(m->forward(make_batch({{1, 2, 3, 4}}, {}, at::kCPU)));
  EXPECT_LE(max_rel_diff(got[0], full[3]), 1e-5);
  // A one-token prompt is a decode step with no cached context (the engine plans no context
  // slots for it): it sees only itself.
  {
    ContiguousKvCache c1(c, 1, 4, at::kFloat, at::kCPU);
    auto b1 = make_batch({{9}}, {}, at::kCPU);
    auto m1 = c1.plan(b1.segs, {0}, /*batched_decode=*/false);
    m1.context_slots[0] = at::Tensor();
    auto one = m->logits(m->forward(b1, nullptr, &c1.pool(), &m1));
    EXPECT_LE(max_rel_diff(one[0], m->logits(m->forward(make_batch({{9}}, {}, at::kCPU)))[0]), 1e-5);
  }
  // A plan naming a slot outside the pool is refused, not read.
  auto bad = make_batch({{5}}, {4}, at::kCPU);
  auto bm = cache.plan(bad.segs, {0}, /*batched_decode=*/false);
  bm.context_slots[0][2] = 1 << 20;
  EXPECT_THROW(m->forward(bad, nullptr, &cache.pool(), &bm), Error);
  set_cpu_fast_paths(prev);
}

// A decode batch of 20 sequences (past the outer-product kernel's 12 rows: the projections with
// the adapters' A products, and the LM head run on it), then a mixed step of 70 tokens, with two
// adapters and base rows: equal to the libtorch path.
TEST(CpuDecode, ManyRowStepsOnTheGemmKernelEqualTheLibtorchPath) {
  static_assert(cpu::kGemmMinRows <= 13);
  const ModelConfig c = tiny_config();
  auto m = DecoderModel::from_named(c, random_weights(c, 3, at::kFloat, 0.1), at::kFloat, at::kCPU);
  auto a1 = busy_adapter(c, 4, 21), a2 = busy_adapter(c, 8, 22);
  at::NoGradGuard ng;
  constexpr int S = 20;
  std::vector<int> slot_of(S);
  for (int i = 0; i < S; ++i) slot_of[static_cast<std::size_t>(i)] = i < 13 ? 0 : (i < 17 ? 1 : -1);
  auto run = [&] {
    ContiguousKvCache cache(c, S, 64, at::kFloat, at::kCPU);
    std::vector<std::vector<std::int64_t>> prompts;
    std::vector<std::int64_t> past, seqs;
    for (int i = 0; i < S; ++i) {
      prompts.push_back({});
      for (int j = 0; j <= i % 5; ++j) prompts.back().push_back(1 + (i * 7 + j) % 60);
      past.push_back(static_cast<std::int64_t>(prompts.back().size()));
      seqs.push_back(i);
    }
    auto pb = make_batch(prompts, {}, at::kCPU);
    auto pm = cache.plan(pb.segs, seqs);
    m->forward(pb, nullptr, &cache.pool(), &pm);
    auto lora = LoraBatch::from_row_slots({&a1, &a2}, slot_of, at::kCPU);
    std::vector<at::Tensor> out;
    for (int step = 0; step < 3; ++step) {
      std::vector<std::vector<std::int64_t>> toks;
      for (int i = 0; i < S; ++i) toks.push_back({(i + step * 3) % 60 + 1});
      auto db = make_batch(toks, past, at::kCPU);
      auto dm = cache.plan(db.segs, seqs, /*batched_decode=*/true);
      out.push_back(m->logits(m->forward(db, &lora, &cache.pool(), &dm)));
      for (auto& p : past) ++p;
    }
    // A mixed step: sequences 0-6 add chunks of 10 tokens (70 rows: past the 64 rows up to which
    // the A products join the base projections, so LoRA takes the gathered path), adapter 0 on
    // the first two (20 rows, on the outer-product kernel), adapter 1 on the fourth (10 rows).
    std::vector<std::vector<std::int64_t>> chunks(7);
    std::vector<int> row_slot;
    for (int i = 0; i < 7; ++i)
      for (int j = 0; j < 10; ++j) {
        chunks[static_cast<std::size_t>(i)].push_back(1 + (i * 13 + j) % 60);
        row_slot.push_back(i < 2 ? 0 : (i == 3 ? 1 : -1));
      }
    auto mb = make_batch(chunks, {past.begin(), past.begin() + 7}, at::kCPU);
    auto mm = cache.plan(mb.segs, {0, 1, 2, 3, 4, 5, 6});
    auto ml = LoraBatch::from_row_slots({&a1, &a2}, row_slot, at::kCPU);
    out.push_back(m->logits(m->forward(mb, &ml, &cache.pool(), &mm)));
    return out;
  };
  std::vector<at::Tensor> want, got;
  {
    const bool prev = set_cpu_fast_paths(false);
    want = run();
    set_cpu_fast_paths(prev);
  }
  both_isas([&] {
    const bool prev = set_cpu_fast_paths(true);
    got = run();
    set_cpu_fast_paths(prev);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_LE(max_rel_diff(got[i], want[i]), 1e-5) << "step " << i;
  });
}

// The LM head reuses its output buffer only once the caller has let go of it: a result still held
// (or a view of it) is never overwritten by the next call.
TEST(CpuDecode, LogitsHeldByTheCallerAreNotOverwritten) {
  const ModelConfig c = tiny_config();
  auto m = DecoderModel::from_named(c, random_weights(c, 4, at::kFloat, 0.1), at::kFloat, at::kCPU);
  at::NoGradGuard ng;
  auto h1 = at::randn({16, c.hidden_size}), h2 = at::randn({16, c.hidden_size});
  auto first = m->logits(h1);
  const auto want1 = first.clone();
  auto row = first[3];  // a view keeps the storage too
  first = at::Tensor();
  auto second = m->logits(h2);
  EXPECT_TRUE(at::equal(row, want1[3]));
  EXPECT_LE(max_rel_diff(second, at::linear(h2, m->lm_head_weight())), 1e-5);
  row = at::Tensor();
  // Released: the next call may take the buffer; its values are the new ones.
  second = at::Tensor();
  EXPECT_LE(max_rel_diff(m->logits(h1), want1), 0.0);
}

// A mixed step (a decode row, a prefill chunk after cached tokens, a fresh prompt) with adapters
// on some rows takes the fast path too and equals the libtorch path.
TEST(CpuDecode, MixedStepsEqualTheLibtorchPath) {
  const ModelConfig c = tiny_config();
  auto m = DecoderModel::from_named(c, random_weights(c, 2, at::kFloat, 0.1), at::kFloat, at::kCPU);
  auto a1 = busy_adapter(c, 2, 3);
  at::NoGradGuard ng;
  auto run = [&](bool fast) {
    const bool prev = set_cpu_fast_paths(fast);
    ContiguousKvCache cache(c, 3, 32, at::kFloat, at::kCPU);
    auto pb = make_batch({{1, 2, 3, 4}, {5, 6}}, {}, at::kCPU);
    auto pm = cache.plan(pb.segs, {0, 1});
    m->forward(pb, nullptr, &cache.pool(), &pm);
    // seq 0 decodes one token, seq 1 adds a chunk of 3, seq 2 starts with a prompt of 5.
    auto mb = make_batch({{7}, {8, 9, 10}, {11, 12, 13, 14, 15}}, {4, 2, 0}, at::kCPU);
    auto mm = cache.plan(mb.segs, {0, 1, 2});
    EXPECT_FALSE(mm.decode_slots.defined());
    std::vector<int> row_slot = {0, -1, -1, -1, 0, 0, 0, 0, 0};
    auto lora = LoraBatch::from_row_slots({&a1}, row_slot, at::kCPU);
    auto out = m->logits(m->forward(mb, &lora, &cache.pool(), &mm));
    set_cpu_fast_paths(prev);
    return out;
  };
  auto want = run(false);
  both_isas([&] { EXPECT_LE(max_rel_diff(run(true), want), 1e-5); });
}

std::size_t threads_of_this_process() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST(Runtime, ReleasingAThreadsComputeWorkersEndsThemAndParallelWorkGoesOn) {
  // A thread that ran parallel work keeps its idle workers until it ends or releases them (the
  // engine relies on this: a pool left by the loading thread made its own workers sleep).
  set_compute_threads(2);
  const std::size_t before = threads_of_this_process();
  std::size_t during = 0, after = 0;
  std::atomic<std::int64_t> sum{0}, again{0};
  auto work = [](std::atomic<std::int64_t>& total) {  // the kernels' parallel loop (OpenMP's)
    cpu::parallel_for_cost(
        1 << 16, [](std::int64_t) { return std::int64_t{1}; },
        [&](std::int64_t b, std::int64_t e) {
          std::int64_t s = 0;
          for (auto i = b; i < e; ++i) s += i;
          total += s;
        });
  };
  std::thread loader([&] {
    work(sum);
    during = threads_of_this_process();
    release_compute_threads();
    after = threads_of_this_process();
    work(again);  // a new pool starts on demand
    release_compute_threads();
  });
  loader.join();
  const std::int64_t want = (std::int64_t{1} << 16) * ((std::int64_t{1} << 16) - 1) / 2;
  EXPECT_EQ(sum.load(), want);
  EXPECT_EQ(again.load(), want);
  if (at::get_parallel_info().find("OpenMP") == std::string::npos || during <= before + 1)
    GTEST_SKIP() << "no OpenMP worker pool in this build (" << before << " threads, " << during << " during)";
  EXPECT_LT(after, during) << "the loader's idle worker is ended";
}

}  // namespace
}  // namespace lorasync::model
