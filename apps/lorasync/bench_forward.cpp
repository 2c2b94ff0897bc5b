// `lorasync bench forward`: prefill and decode throughput of a model configuration with random
// weights (no disk), and utilisation against the GEMM peak measured in the same run.
//  - prefill: `prefill_batch` prompts of `prompt_tokens` tokens in one flat batch written to a KV
//    cache, LM head on the last token of each (as a server does); on CPU ours against the libtorch
//    path like decode;
//  - decode: batch b sequences with `context` cached tokens, `decode_steps` steps of one token each
//    through the batched decode path, LM head included; on CPU our decode kernels against the
//    libtorch path of the same maths (model::set_cpu_fast_paths) in the same run;
//  - prefill and decode with adapters (--adapters N, fast path): the same steps with N resident
//    rank-8 all-linear adapters, prompts or decode rows dealt round-robin to them (as a server's
//    mixed batch), timed alternately with the base model (best of each);
//  - sample: one sampler call over [b, vocab] logits (temperature 1, the logprob of the drawn
//    token), ours against the libtorch expression.
// bench/llamacpp_compare.py runs this next to llama.cpp on a GGUF conversion of the same weights.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <random>

#include "commands.h"
#include "core/model/cpu_kernels.h"
#include "core/model/decode_graphs.h"
#include "core/model/device_kernels.h"
#include "core/model/lora.h"
#include "core/model/perf.h"
#include "core/model/decoder_model.h"
#include "core/model/runtime.h"
#include "engine/sampler.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/log.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace {

struct BenchForwardOptions {
  std::string presets = "tiny,small";
  std::int64_t prompt_tokens = 256;
  std::int64_t prefill_batch = 4;
  std::string decode_batches = "1,8,64";
  std::int64_t context = 128;
  std::int64_t decode_steps = 8;
  std::string dtype = "auto";
  std::string device = "cpu";
  int threads = 0;
  int repeats = 3;
  std::string paths = "fast,reference";
  int adapters = 5;  // resident adapters for the mixed decode (0: not timed)
};

double seconds_of(const std::function<void()>& f, c10::Device device, int repeats) {
  f();  // warm-up
  model::device_synchronize(device);
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    model::device_synchronize(device);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// The run's memory roofline: a copy of 1 GiB on a device (256 MiB on the CPU), bytes read plus
// bytes written over its best time. Decode at batch 1 streams the weights once per token, so its
// weight stream over this is the share of the memory bound it reaches.
double copy_gb_per_s(c10::Device device) {
  const std::int64_t bytes = (device.is_cpu() ? std::int64_t{256} : std::int64_t{1024}) << 20;
  auto src = at::ones({bytes / 4}, at::TensorOptions().dtype(at::kFloat).device(device));
  auto dst = at::empty_like(src);
  const double s = seconds_of([&] { dst.copy_(src); }, device, 5);
  return 2.0 * static_cast<double>(bytes) / s / 1e9;
}

// The same decode steps replayed from CUDA graphs (model/decode_graphs.h) on a copy of the cache
// (plus the padding rows' scratch slot), against the eager steps timed just before.
void bench_decode_graphs(BenchReporter& rep, const model::DecoderModel& m, model::ContiguousKvCache& cache, std::int64_t b,
                         std::int64_t cap, std::vector<std::int64_t> pos, std::int64_t steps, int repeats,
                         std::optional<double> eager_tps, nlohmann::json cfg) {
  const auto& c = m.config();
  auto pool = model::KvPool::allocate(c, b * cap + 1, m.dtype(), m.device());
  for (std::size_t l = 0; l < pool.k.size(); ++l) {
    pool.k[l].narrow(0, 0, b * cap).copy_(cache.pool().k[l]);
    pool.v[l].narrow(0, 0, b * cap).copy_(cache.pool().v[l]);
  }
  model::DecodeGraphs::Options go;
  go.buckets = {b};
  go.max_context = cap;
  go.scratch_slot = b * cap;
  model::DecodeGraphs graphs(m, pool, go);
  auto step_all = [&] {
    for (std::int64_t st = 0; st < steps; ++st) {
      model::DecodeStep ds;
      for (std::int64_t i = 0; i < b; ++i) {
        const auto p = pos[static_cast<std::size_t>(i)];
        if (p + 1 > cap) throw_invalid("bench forward: the decode graphs' cache of {} tokens is full", cap);
        ds.tokens.push_back((i * 7 + p) % c.vocab_size);
        ds.positions.push_back(p);
        ds.slot_mapping.push_back(i * cap + p);
        ds.lens.push_back(p + 1);
        for (std::int64_t q = 0; q <= p; ++q) ds.context.push_back(i * cap + q);
      }
      (void)graphs.run(ds, {});
      for (auto& p : pos) ++p;
    }
  };
  const double secs = seconds_of(step_all, m.device(), repeats);
  const double tps = static_cast<double>(b * steps) / secs;
  cfg["path"] = "cuda_graphs";
  cfg["captures"] = graphs.stats().captures;
  cfg["capture_ms"] = 1e3 * graphs.stats().capture_seconds;
  cfg["baseline"] = "eager decode steps of the same run";
  rep.emit({"forward", "decode_tokens_per_s_graphs", tps, "tokens/s", eager_tps, cfg});
}

// The mixed-adapter timing against the base model's: `pairs` pairs (at least 5) of adjacent
// timings, the order swapped every pair so a drift hurts both sides alike; returns the best of each
// (the base's including `base_best`, timed before) and records the median of the pairs' ratios
// (base time / mixed time) in cfg["pair_ratio_median"]: on the 2-core VM the base decode alone
// moved by 25% from one timing to the next, and the median of adjacent pairs is the steadier figure.
std::pair<double, double> alternate(const std::function<double(bool)>& time_one, double base_best, int pairs,
                                    nlohmann::json& cfg) {
  double mixed_best = 1e30;
  std::vector<double> ratios;
  for (const auto& [t_mixed, t_base] : alternate_pairs(std::max(5, pairs), time_one)) {
    mixed_best = std::min(mixed_best, t_mixed);
    base_best = std::min(base_best, t_base);
    ratios.push_back(t_base / t_mixed);
  }
  cfg["pairs"] = ratios.size();
  cfg["pair_ratio_median"] = percentile(ratios, 50);
  return {mixed_best, base_best};
}

// --paths in the order reference, fast-avx2, fast: each is a baseline of the next.
int path_rank(const std::string& path) { return path == "reference" ? 0 : path == "fast-avx2" ? 1 : 2; }
std::vector<std::string> parse_paths(const std::string& list) {
  std::vector<std::string> paths;
  for (const auto& p : split(list, ',')) {
    const std::string path(trim(p));
    if (path != "fast" && path != "fast-avx2" && path != "reference")
      throw_invalid("--paths: unknown path '{}' (fast, fast-avx2, reference)", path);
    paths.push_back(path);
  }
  std::stable_sort(paths.begin(), paths.end(), [](const auto& x, const auto& y) { return path_rank(x) < path_rank(y); });
  return paths;
}

// Our kernels on (fast, fast-avx2) or off (reference); fast-avx2 forbids the AVX-512 tiles.
struct PathGuard {
  explicit PathGuard(const std::string& path)
      : fast_(model::set_cpu_fast_paths(path != "reference")),
        avx512_(model::cpu::set_avx512_allowed(path != "fast-avx2")) {}
  ~PathGuard() {
    model::set_cpu_fast_paths(fast_);
    model::cpu::set_avx512_allowed(avx512_);
  }
  PathGuard(const PathGuard&) = delete;
  PathGuard& operator=(const PathGuard&) = delete;

 private:
  bool fast_, avx512_;
};

int run(const BenchForwardOptions& o) {
  model::set_compute_threads(o.threads);
  auto device = model::parse_device(o.device);
  auto dtype = model::parse_dtype(o.dtype, device, "--dtype");
  BenchReporter rep;
  const double peak = model::gemm_peak_gflops(dtype, device);
  nlohmann::json env = {{"dtype", model::dtype_name(dtype)}, {"device", device.str()},
                        {"threads", model::compute_threads()}};
  if (device.is_cpu()) env["cpu_kernels"] = model::cpu::kernels_name();
  rep.emit({"forward", "gemm_peak_gflops", peak, "GFLOP/s", std::nullopt, env});
  const double copy_bw = copy_gb_per_s(device);
  rep.emit({"forward", "copy_gb_per_s", copy_bw, "GB/s", std::nullopt, env});
  at::NoGradGuard ng;
  for (const auto& pname : split(o.presets, ',')) {
    const std::string preset(trim(pname));
    auto cfg = model::ModelConfig::preset(preset);
    LS_LOG_INFO("bench", "forward: building random {} model ({:.1f}M params)", preset,
                static_cast<double>(cfg.n_params()) / 1e6);
    auto m = model::DecoderModel::from_named(cfg, model::random_weights(cfg, 0, dtype), dtype, device);
    // Rank-8 all-linear adapters with random A and B (B is zero at init: a real one is not).
    std::vector<model::LoraAdapter> adapters;
    for (int a = 0; a < o.adapters; ++a) {
      model::LoraConfig lc;
      lc.rank = 8;
      lc.alpha = 16;
      lc.targets = model::LoraConfig::parse_targets({"all-linear"});
      auto ad = model::LoraAdapter::init(lc, cfg, static_cast<std::uint64_t>(a + 1), at::kCPU);
      for (std::int64_t l = 0; l < ad.n_layers(); ++l)
        for (auto mod : lc.targets) ad.B(l, mod).normal_(0, 0.05);
      adapters.push_back(ad.to(device));
    }
    auto cfg_json = env;
    cfg_json["preset"] = preset;
    cfg_json["params"] = cfg.n_params();

    // Prefill.
    std::vector<std::vector<std::int64_t>> prompts(static_cast<std::size_t>(o.prefill_batch));
    for (std::size_t i = 0; i < prompts.size(); ++i)
      for (std::int64_t t = 0; t < o.prompt_tokens; ++t)
        prompts[i].push_back((static_cast<std::int64_t>(i) * 7919 + t * 104729) % cfg.vocab_size);
    auto batch = model::make_batch(prompts, {}, device);
    std::vector<std::int64_t> last_rows;
    for (std::int64_t i = 0; i < o.prefill_batch; ++i) last_rows.push_back((i + 1) * o.prompt_tokens - 1);
    auto rows = at::tensor(last_rows, at::TensorOptions().dtype(at::kLong)).to(device);
    // The prompts' keys and values are written to a KV cache, as a server's prefill does (on CPU
    // that is the fast path's: our kernels for the projections, libtorch's attention).
    model::ContiguousKvCache pcache(cfg, o.prefill_batch, o.prompt_tokens, dtype, device);
    std::vector<std::int64_t> pids;
    for (std::int64_t i = 0; i < o.prefill_batch; ++i) pids.push_back(i);
    auto pmeta = pcache.plan(batch.segs, pids);
    const std::vector<std::string> paths = parse_paths(o.paths);
    const double n_tok = static_cast<double>(o.prefill_batch * o.prompt_tokens);
    double flops = model::forward_flops(cfg, n_tok, static_cast<double>(o.prompt_tokens) / 2,
                                        static_cast<double>(o.prefill_batch));
    std::optional<double> ref_prefill, avx2_prefill;
    for (const auto& path : paths) {
      double s = 0;
      {
        PathGuard guard(path);
        s = seconds_of([&] { (void)m->logits(m->forward(batch, nullptr, &pcache.pool(), &pmeta).index_select(0, rows)); },
                       device, o.repeats);
      }
      auto c = cfg_json;
      c["batch"] = o.prefill_batch;
      c["prompt_tokens"] = o.prompt_tokens;
      c["path"] = path;
      if (path == "reference") {
        ref_prefill = n_tok / s;
        rep.emit({"forward", "prefill_tokens_per_s_reference", n_tok / s, "tokens/s", std::nullopt, c});
        continue;
      }
      if (path == "fast-avx2") {
        avx2_prefill = n_tok / s;
        rep.emit({"forward", "prefill_tokens_per_s_avx2", n_tok / s, "tokens/s", ref_prefill, c});
        continue;
      }
      rep.emit({"forward", "prefill_tokens_per_s", n_tok / s, "tokens/s", ref_prefill, c});
      if (avx2_prefill) rep.emit({"forward", "prefill_tokens_per_s_vs_avx2", n_tok / s, "tokens/s", avx2_prefill, c});
      rep.emit({"forward", "prefill_gflops", flops / s / 1e9, "GFLOP/s", peak, c});
      if (adapters.empty()) continue;
      // Prompt i on adapter i % N, alternating with the base model (best of each, as for decode).
      std::vector<const model::LoraAdapter*> slots;
      for (const auto& a : adapters) slots.push_back(&a);
      std::vector<int> row_slot;
      for (std::int64_t i = 0; i < o.prefill_batch; ++i)
        for (std::int64_t t = 0; t < o.prompt_tokens; ++t)
          row_slot.push_back(static_cast<int>(i % static_cast<std::int64_t>(slots.size())));
      auto lora = model::LoraBatch::from_row_slots(slots, row_slot, device);
      const bool prev2 = model::set_cpu_fast_paths(true);
      const auto [ms, bs] = alternate(
          [&](bool mixed) {
            return seconds_of(
                [&] { (void)m->logits(m->forward(batch, mixed ? &lora : nullptr, &pcache.pool(), &pmeta).index_select(0, rows)); },
                device, 1);
          },
          s, o.repeats, c);
      model::set_cpu_fast_paths(prev2);
      c["adapters"] = adapters.size();
      c["rank"] = 8;
      rep.emit({"forward", "prefill_tokens_per_s_adapters", n_tok / ms, "tokens/s", n_tok / bs, c});
    }

    // Decode at several batch sizes.
    for (auto b : parse_int_list(o.decode_batches, "--decode-batches")) {
      // Every timing runs decode_steps tokens on the same cache, so later ones see longer contexts:
      // (1 + repeats) for each path, 2 x max(5, repeats) pairs for --adapters, each with a warm-up,
      // and (1 + repeats) for the decode graphs on CUDA.
      const std::int64_t cap =
          o.context + o.decode_steps * (2 * (o.repeats + 1 + 2 * std::max(5, o.repeats)) + o.repeats + 1) + 1;
      model::ContiguousKvCache cache(cfg, b, cap, dtype, device);
      std::vector<std::vector<std::int64_t>> ctx(static_cast<std::size_t>(b));
      std::vector<std::int64_t> ids;
      for (std::int64_t i = 0; i < b; ++i) {
        ids.push_back(i);
        for (std::int64_t t = 0; t < o.context; ++t)
          ctx[static_cast<std::size_t>(i)].push_back((i * 31 + t * 17) % cfg.vocab_size);
      }
      // Prefill the contexts a few sequences at a time (not timed).
      for (std::int64_t i = 0; i < b; i += 8) {
        std::vector<std::vector<std::int64_t>> part;
        std::vector<std::int64_t> part_ids;
        for (std::int64_t j = i; j < std::min(b, i + 8); ++j) {
          part.push_back(ctx[static_cast<std::size_t>(j)]);
          part_ids.push_back(j);
        }
        auto pb = model::make_batch(part, {}, device);
        auto meta = cache.plan(pb.segs, part_ids);
        m->forward(pb, nullptr, &cache.pool(), &meta);
      }
      std::vector<std::int64_t> pos(static_cast<std::size_t>(b), o.context);
      // Rows dealt round-robin to the adapters (the mixed decode); the LoraBatch is built per step,
      // as the engine does.
      std::vector<const model::LoraAdapter*> slots;
      for (const auto& a : adapters) slots.push_back(&a);
      std::vector<int> row_slot;
      for (std::int64_t i = 0; i < b; ++i) row_slot.push_back(slots.empty() ? -1 : static_cast<int>(i % static_cast<std::int64_t>(slots.size())));
      bool with_adapters = false;
      auto step_all = [&] {
        for (std::int64_t st = 0; st < o.decode_steps; ++st) {
          std::vector<std::vector<std::int64_t>> one(static_cast<std::size_t>(b), std::vector<std::int64_t>{1});
          auto db = model::make_batch(one, pos, device);
          auto meta = cache.plan(db.segs, ids);
          std::optional<model::LoraBatch> lora;
          if (with_adapters) lora = model::LoraBatch::from_row_slots(slots, row_slot, device);
          (void)m->logits(m->forward(db, lora ? &*lora : nullptr, &cache.pool(), &meta));
          for (auto& p : pos) ++p;
        }
      };
      const double toks = static_cast<double>(b * o.decode_steps);
      double dflops = model::forward_flops(cfg, toks, static_cast<double>(o.context), toks);
      auto dc = cfg_json;
      dc["batch"] = b;
      dc["context"] = o.context;
      // The reference path first (when asked), then ours with it as the baseline.
      std::optional<double> ref_tps, ref_sample;
      at::Tensor logits = at::randn({b, cfg.vocab_size}, at::TensorOptions().dtype(at::kFloat)) * 3.0;
      engine::SamplingParams sp;
      sp.temperature = 1.0;
      std::vector<std::mt19937_64> rngs(static_cast<std::size_t>(b));
      std::vector<engine::SampleRow> srows;
      for (auto& g : rngs) srows.push_back({&sp, &g, nullptr});
      auto sample_once = [&] { (void)engine::sample_batch(logits, srows); };
      std::optional<double> eager_tps, avx2_tps;
      for (const auto& path : paths) {
        const bool fast = path != "reference";
        double ds = 0, ss = 0;
        {
          PathGuard guard(path);
          ds = seconds_of(step_all, device, o.repeats);
          ss = device.is_cpu() && path != "fast-avx2" ? seconds_of(sample_once, device, o.repeats) : 0.0;
        }
        auto pc = dc;
        pc["path"] = path;
        const double tps = toks / ds;
        if (!fast) {
          ref_tps = tps;
          ref_sample = 1.0 / ss;
          rep.emit({"forward", "decode_tokens_per_s_reference", tps, "tokens/s", std::nullopt, pc});
          continue;
        }
        if (path == "fast-avx2") {
          avx2_tps = tps;
          rep.emit({"forward", "decode_tokens_per_s_avx2", tps, "tokens/s", ref_tps, pc});
          continue;
        }
        rep.emit({"forward", "decode_tokens_per_s", tps, "tokens/s", ref_tps, pc});
        if (avx2_tps) rep.emit({"forward", "decode_tokens_per_s_vs_avx2", tps, "tokens/s", avx2_tps, pc});
        eager_tps = tps;
        rep.emit({"forward", "decode_gflops", dflops / ds / 1e9, "GFLOP/s", peak, pc});
        const double weight_bytes = static_cast<double>(cfg.n_params()) * static_cast<double>(at::elementSize(dtype));
        rep.emit({"forward", "decode_weight_stream_gb_per_s", weight_bytes * static_cast<double>(o.decode_steps) / ds / 1e9,
                  "GB/s", copy_bw, pc});
        if (device.is_cpu())
          rep.emit({"forward", "sample_calls_per_s", 1.0 / ss, "calls/s", ref_sample, pc});
        if (!adapters.empty()) {
          // The mixed batch and the base model alternate, `repeats` timings each, and each keeps
          // its best: the machine's pace drifts between timings (on the 2-core VM the base decode
          // alone moved by 25% within one run), and alternating exposes both sides to it alike.
          const bool prev2 = model::set_cpu_fast_paths(true);
          auto ac = pc;
          const auto [ms, bs2] = alternate(
              [&](bool mixed) {
                with_adapters = mixed;
                return seconds_of(step_all, device, 1);
              },
              ds, o.repeats, ac);
          with_adapters = false;
          model::set_cpu_fast_paths(prev2);
          ac["adapters"] = adapters.size();
          ac["rank"] = 8;
          rep.emit({"forward", "decode_tokens_per_s_adapters", toks / ms, "tokens/s", toks / bs2, ac});
        }
      }
      if (device.is_cuda() && model::have_cuda_kernels() && eager_tps)
        bench_decode_graphs(rep, *m, cache, b, cap, pos, o.decode_steps, o.repeats, eager_tps, dc);
    }
  }
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_forward(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchForwardOptions>();
  auto* sub = bench.add_subcommand("forward", "prefill and decode throughput of a model shape");
  sub->add_option("--presets", o->presets,
                  "comma list: tiny,small,qwen2.5-1.5b-shape,qwen3-tiny,qwen3-shape,llama3-tiny,llama3-shape")
      ->capture_default_str();
  sub->add_option("--prompt-tokens", o->prompt_tokens, "tokens per prefill prompt")->capture_default_str();
  sub->add_option("--prefill-batch", o->prefill_batch, "prompts per prefill batch")->capture_default_str();
  sub->add_option("--decode-batches", o->decode_batches, "decode batch sizes")->capture_default_str();
  sub->add_option("--context", o->context, "cached tokens per sequence before decode")->capture_default_str();
  sub->add_option("--decode-steps", o->decode_steps, "decode steps per timing")->capture_default_str();
  sub->add_option("--dtype", o->dtype, "auto|float32|bfloat16|float16")->capture_default_str();
  sub->add_option("--device", o->device, "cpu|cuda[:N]")->capture_default_str();
  sub->add_option("--threads", o->threads, "0 = all cores")->capture_default_str();
  sub->add_option("--repeats", o->repeats, "timed repetitions (best is kept)")->capture_default_str();
  sub->add_option("--adapters", o->adapters, "resident rank-8 adapters for the mixed decode (0: none)")
      ->capture_default_str();
  sub->add_option("--paths", o->paths,
                  "paths to time: fast (our CPU kernels), fast-avx2 (ours without the AVX-512 tiles), reference (libtorch)")
      ->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
