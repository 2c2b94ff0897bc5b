// GPU tests (label `gpu`): run by scripts/gpu-check on a machine with a CUDA device; every test
// skips where none exists (CI, the development machines). Each kernel or device path is compared
// with its reference, the plain libtorch expression on the CPU in fp32:
//   - our fused RMSNorm kernel (the cuda preset) in fp32, bf16 and fp16 against rms_norm_reference;
//   - fused attention on CUDA (flash / memory-efficient) against segment_attention_reference;
//   - the packed row's varlen flash attention against the per-segment path, with gradients;
//   - a whole random model: bf16 and fp32 logits on CUDA against fp32 on the CPU, with and without
//     a LoRA adapter, and the trainer's packed logprobs with their gradient.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cstdio>

#include "core/model/device_kernels.h"
#include "core/model/logprobs.h"
#include "core/model/lora.h"
#include "core/model/qwen2_model.h"

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

TEST(Gpu, ModelLogitsOnCudaMatchTheCpu) {
  REQUIRE_GPU();
  Qwen2Config c = Qwen2Config::preset("tiny");
  c.vocab_size = 2048;
  auto w = random_weights(c, 3, at::kFloat, 0.1);
  auto cpu = Qwen2Model::from_named(c, w, at::kFloat, at::kCPU);
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
      auto gpu = Qwen2Model::from_named(c, w, dt, at::Device(at::kCUDA, 0));
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

}  // namespace
}  // namespace lorasync::model
