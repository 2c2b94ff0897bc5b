// `lorasync bench train`: the GRPO trainer's compute on packed rows of a model configuration with
// random weights: LoRA forward + backward of the token loss (step_start, rank r, all-linear), then
// clipping and AdamW. Reports trained tokens/s, utilisation against the GEMM peak measured in the
// same run (trainer.md §6 FLOP formula), rows filled, and optimiser step time.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cstdio>
#include <random>

#include "commands.h"
#include "core/model/perf.h"
#include "core/model/qwen2_model.h"
#include "core/model/runtime.h"
#include "rl/grpo_loss.h"
#include "rl/optimizer.h"
#include "rl/packed_forward.h"
#include "rl/packing.h"
#include "util/bench_report.h"
#include "util/log.h"

namespace lorasync::cli {

namespace {

struct BenchTrainOptions {
  std::string preset = "small";
  std::int64_t samples = 32;
  std::int64_t prompt_tokens = 120;
  std::int64_t max_completion = 600;
  std::int64_t row_tokens = 4096;
  std::int64_t rank = 1;
  std::int64_t logits_chunk = 512;  // 256-512 measured best on CPU (L2-sized chunks); 2048 on GPU
  int steps = 2;
  int threads = 0;
  std::string device = "cpu";
  std::string dtype = "auto";  // fp32 on CPU, bf16 on CUDA (LoRA masters and AdamW stay fp32)
};

int run(const BenchTrainOptions& o) {
  model::set_compute_threads(o.threads);
  const auto device = model::parse_device(o.device);
  const auto dtype = model::parse_dtype(o.dtype, device, "--dtype");
  auto cfg = model::Qwen2Config::preset(o.preset);
  BenchReporter rep;
  const double peak = model::gemm_peak_gflops(dtype, device);
  LS_LOG_INFO("bench", "train: building random {} model ({}, {})", o.preset, model::dtype_name(dtype), o.device);
  auto m = model::Qwen2Model::from_named(cfg, model::random_weights(cfg, 0, dtype), dtype, device);
  model::LoraConfig lc;
  lc.rank = o.rank;
  lc.alpha = 2.0 * static_cast<double>(o.rank);
  lc.targets = model::LoraConfig::parse_targets({"all-linear"});
  auto adapter = model::LoraAdapter::init(lc, cfg, 1, device);
  adapter.set_requires_grad(true);
  rl::AdamW opt(adapter.parameters(), {});
  rl::LossConfig loss_cfg;
  loss_cfg.old_policy = rl::OldPolicy::kStepStart;

  std::mt19937 rng(3);
  std::vector<rl::PackedSample> samples;
  std::vector<rl::PackItem> items;
  std::int64_t completion_tokens = 0;
  for (std::int64_t i = 0; i < o.samples; ++i) {
    rl::PackedSample s;
    const auto T = 1 + static_cast<std::int64_t>(rng() % static_cast<unsigned>(o.max_completion));
    for (std::int64_t t = 0; t < o.prompt_tokens; ++t) s.prompt.push_back(static_cast<std::int64_t>(rng() % 150000));
    for (std::int64_t t = 0; t < T; ++t) s.completion.push_back(static_cast<std::int64_t>(rng() % 150000));
    completion_tokens += T;
    items.push_back({o.prompt_tokens + T, i / 8, i % 8});
    samples.push_back(std::move(s));
  }
  auto plan = rl::plan_rows(items, o.row_tokens);
  double fb_s = 0, opt_s = 0;
  std::int64_t tokens = 0;
  double flops = 0;
  for (const auto& it : items) {
    const double L = static_cast<double>(it.length);
    flops += 4.0 * static_cast<double>(cfg.n_linear_params()) * L +
             6.0 * static_cast<double>(cfg.num_hidden_layers * cfg.q_dim()) * L * L;
    tokens += it.length;
  }
  flops += 4.0 * static_cast<double>(cfg.hidden_size * cfg.vocab_size) * static_cast<double>(completion_tokens);
  if (device.is_cuda()) model::reset_peak_device_memory(device);
  for (int step = 0; step <= o.steps; ++step) {  // step 0 warms up
    model::device_synchronize(device);
    auto t0 = std::chrono::steady_clock::now();
    for (const auto& row : plan.rows) {
      std::vector<rl::PackedSample> rs;
      for (auto i : row) rs.push_back(samples[i]);
      auto out = rl::packed_row_logprobs(*m, &adapter, rs, 1.0, o.logits_chunk);
      at::Tensor mu, adv;
      {
        at::NoGradGuard ng;
        mu = out.logprobs.detach() - 0.01;
        adv = at::ones_like(mu) * 0.5;
      }
      auto loss = rl::grpo_token_losses({out.logprobs, mu, {}, adv, {}}, loss_cfg).sum() /
                  static_cast<double>(o.samples * o.max_completion);
      loss.backward();
    }
    model::device_synchronize(device);
    auto t1 = std::chrono::steady_clock::now();
    rl::clip_grad_norm(adapter.parameters(), 1.0);
    opt.step(4e-5);
    opt.zero_grad();
    model::device_synchronize(device);
    auto t2 = std::chrono::steady_clock::now();
    if (step > 0) {
      fb_s += std::chrono::duration<double>(t1 - t0).count();
      opt_s += std::chrono::duration<double>(t2 - t1).count();
    }
  }
  fb_s /= o.steps;
  opt_s /= o.steps;
  nlohmann::json c = {{"preset", o.preset}, {"samples", o.samples}, {"rows", plan.rows.size()},
                      {"row_tokens", o.row_tokens}, {"rank", o.rank}, {"threads", model::compute_threads()},
                      {"tokens_per_step", tokens}, {"logits_chunk", o.logits_chunk},
                      {"device", o.device}, {"dtype", model::dtype_name(dtype)}};
  rep.emit({"train", "gemm_peak_gflops", peak, "GFLOP/s", std::nullopt, c});
  rep.emit({"train", "trained_tokens_per_s", static_cast<double>(tokens) / fb_s, "tokens/s", std::nullopt, c});
  rep.emit({"train", "fwd_bwd_gflops", flops / fb_s / 1e9, "GFLOP/s", peak, c});
  rep.emit({"train", "rows_filled", plan.fill, "fraction", 0.95, c});
  rep.emit({"train", "optimizer_step_ms", opt_s * 1e3, "ms", std::nullopt, c});
  rep.emit({"train", "fwd_bwd_step_s", fb_s, "s", std::nullopt, c});
  if (device.is_cuda())
    rep.emit({"train", "peak_device_memory_gib", static_cast<double>(model::peak_device_memory(device)) / (1 << 30),
              "GiB", std::nullopt, c});
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_train(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchTrainOptions>();
  auto* sub = bench.add_subcommand("train", "LoRA forward+backward on packed rows (trainer compute)");
  sub->add_option("--preset", o->preset, "tiny|small|qwen2.5-1.5b-shape")->capture_default_str();
  sub->add_option("--samples", o->samples, "samples per step")->capture_default_str();
  sub->add_option("--prompt-tokens", o->prompt_tokens, "prompt tokens per sample")->capture_default_str();
  sub->add_option("--max-completion", o->max_completion, "completion tokens drawn in [1, this]")->capture_default_str();
  sub->add_option("--row-tokens", o->row_tokens, "tokens per packed row")->capture_default_str();
  sub->add_option("--rank", o->rank, "LoRA rank (all-linear)")->capture_default_str();
  sub->add_option("--logits-chunk", o->logits_chunk, "LM-head rows per chunk")->capture_default_str();
  sub->add_option("--steps", o->steps, "timed steps (after one warm-up)")->capture_default_str();
  sub->add_option("--threads", o->threads, "0 = all cores")->capture_default_str();
  sub->add_option("--device", o->device, "cpu|cuda[:N]")->capture_default_str();
  sub->add_option("--dtype", o->dtype, "auto|float32|bfloat16|float16 (auto: fp32 on CPU, bf16 on CUDA)")
      ->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
