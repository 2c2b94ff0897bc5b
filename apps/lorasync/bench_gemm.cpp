// `lorasync bench gemm`: the machine's GEMM peak (best square product) and the throughput of the
// model's own shapes, each reported with the peak as its same-run baseline (ratio = utilisation).
#include <ATen/Context.h>

#include <ATen/ATen.h>

#include <cstdio>

#include "commands.h"
#include "core/model/cpu_kernels.h"
#include "core/model/perf.h"
#include "core/model/model_config.h"
#include "core/model/runtime.h"
#include "util/bench_report.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace {

struct BenchGemmOptions {
  std::string preset = "qwen2.5-1.5b-shape";
  std::int64_t tokens = 512;
  std::string dtypes = "float32";
  std::string device = "cpu";
  int threads = 0;
  double seconds = 0.3;
};

int run(const BenchGemmOptions& o) {
  model::set_compute_threads(o.threads);
  auto device = model::parse_device(o.device);
  auto cfg = model::ModelConfig::preset(o.preset);
  BenchReporter rep;
  for (const auto& name : split(o.dtypes, ',')) {
    auto dtype = model::parse_dtype(std::string(trim(name)), device, "--dtypes");
    nlohmann::json base_cfg = {{"dtype", model::dtype_name(dtype)}, {"device", device.str()},
                               {"threads", model::compute_threads()}};
    double peak = model::gemm_peak_gflops(dtype, device, o.seconds);
    rep.emit({"gemm", "peak_gflops", peak, "GFLOP/s", std::nullopt, base_cfg});
    const auto d = cfg.hidden_size, T = o.tokens;
    struct Shape {
      const char* name;
      std::int64_t m, n, k;
    } shapes[] = {{"q_proj", T, cfg.q_dim(), d},          {"kv_proj", T, cfg.kv_dim(), d},
                  {"o_proj", T, d, cfg.q_dim()},          {"gate_up_proj", T, cfg.intermediate_size, d},
                  {"down_proj", T, d, cfg.intermediate_size}, {"lm_head", T, cfg.vocab_size, d},
                  {"decode_gate_up_b1", 1, cfg.intermediate_size, d},
                  {"decode_gate_up_b64", 64, cfg.intermediate_size, d}};
    for (const auto& s : shapes) {
      double g = model::gemm_gflops(s.m, s.n, s.k, dtype, device, o.seconds);
      auto c = base_cfg;
      c["shape"] = s.name;
      c["m"] = s.m;
      c["n"] = s.n;
      c["k"] = s.k;
      c["preset"] = o.preset;
      rep.emit({"gemm", std::string(s.name) + "_gflops", g, "GFLOP/s", peak, c});
    }
  }
  // Our decode kernel (cpu::linear: dot products below kGemmMinRows rows, the outer-product
  // kernel from there) against BLAS on the same fp32 CPU shapes, BLAS timed first.
  if (device.is_cpu()) {
    const auto d = cfg.hidden_size;
    for (std::int64_t m : {16, 64, 256}) {
      struct Shape {
        const char* name;
        std::int64_t n, k;
      } shapes[] = {{"gate_up_proj", 2 * cfg.intermediate_size, d}, {"down_proj", d, cfg.intermediate_size},
                    {"lm_head", cfg.vocab_size, d}};
      for (const auto& s : shapes) {
        auto x = at::randn({m, s.k});
        auto w = at::randn({s.n, s.k});
        auto y = at::empty({m, s.n});
        const double blas = model::gemm_gflops(m, s.n, s.k, at::kFloat, device, o.seconds);
        model::cpu::LinearOut part{w.data_ptr<float>(), nullptr, s.n, y.data_ptr<float>(), s.n};
        const double sec = model::seconds_per_call(
            [&] { model::cpu::linear(x.data_ptr<float>(), m, s.k, s.k, std::span(&part, 1)); }, device, o.seconds);
        const double ours = 2.0 * static_cast<double>(m * s.n * s.k) / sec / 1e9;
        nlohmann::json c = {{"dtype", "float32"}, {"device", "cpu"}, {"threads", model::compute_threads()},
                            {"shape", s.name}, {"m", m}, {"n", s.n}, {"k", s.k}, {"preset", o.preset},
                            {"baseline", "blas"}};
        rep.emit({"gemm", std::string("ours_") + s.name + "_m" + std::to_string(m) + "_gflops", ours, "GFLOP/s",
                  blas, c});
      }
    }
  }
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_gemm(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchGemmOptions>();
  auto* sub = bench.add_subcommand("gemm", "GEMM peak and the model's shapes (utilisation denominator)");
  sub->add_option("--preset", o->preset, "model shapes to measure")->capture_default_str();
  sub->add_option("--tokens", o->tokens, "rows (tokens) of the activation matrix")->capture_default_str();
  sub->add_option("--dtypes", o->dtypes, "comma list: float32,bfloat16,float16")->capture_default_str();
  sub->add_option("--device", o->device, "cpu|cuda[:N]")->capture_default_str();
  sub->add_option("--threads", o->threads, "0 = all cores")->capture_default_str();
  sub->add_option("--seconds", o->seconds, "minimum time per measurement")->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
