// `lorasync bench e2e`: time to accuracy against TRL (bench_e2e_race.cpp); with --transports, the
// demo's configuration (2 replicas, the proxy, the trainer, separate
// processes on this machine; demo.md) for a fixed number of steps, once per sync transport. From
// each run's metrics.jsonl: steps/s, where a step's time goes (waiting for rollouts = generation
// bound; forward/backward, recompute and optimizer = trainer bound; waiting for a weight sync),
// and the sync's share of the wall time. Baseline (same run): the path transport's figures.
#include <nlohmann/json.hpp>

#include "bench_e2e_race.h"
#include "commands.h"
#include "demo/quality.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/files.h"
#include "util/json_lines.h"
#include "util/log.h"
#include "util/process.h"
#include "util/strings.h"
#include "util/supervised_process.h"

namespace lorasync::cli {

namespace {

using nlohmann::json;

struct BenchE2eOptions {
  std::int64_t steps = 12;
  std::string transports = "path,push";
  std::int64_t seed = 1;
};

int run(const BenchE2eOptions& o) {
  TempDir tmp("lorasync-bench-e2e");
  const std::string self = lorasync_executable();
  BenchReporter rep;
  std::map<std::string, std::map<std::string, double>> by_transport;
  for (const auto& t : split(o.transports, ',')) {
    if (t != "path" && t != "push") throw_invalid("--transports takes path and push, got {}", t);
    const fs::path dir = tmp.path() / t;
    LS_LOG_INFO("bench", "bench e2e: demo, {} steps, sync by {} (log {})", o.steps, t, (tmp.path() / (t + ".log")).string());
    const double t0 = now_seconds();
    ChildProcess demo(t, {self, "demo", "--run-dir", dir.string(), "--steps", std::to_string(o.steps), "--eval-problems", "4",
                          "--eval-samples", "1", "--seed", std::to_string(o.seed), "--sync-transport", t},
                      tmp.path());
    const int code = demo.wait();
    const double demo_s = now_seconds() - t0;
    // A few steps cannot meet the demo's quality bar (exit 3, it needs 20 steps to judge): this
    // bench times the loop, it does not judge learning.
    if (code != 0 && code != demo::kDemoDidNotLearn) throw_env("bench e2e: the demo (sync by {}) exited {}: {}", t, code, read_file(tmp.path() / (t + ".log")).substr(0, 4000));
    fs::path mfile;
    for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator(); ++it)
      if (it->path().filename() == "metrics.jsonl") mfile = it->path();
    if (mfile.empty()) throw_env("bench e2e: the demo wrote no metrics.jsonl under {}", dir.string());
    auto ms = read_jsonl(mfile);
    if (ms.size() < 2) throw_env("bench e2e: {} steps recorded", ms.size());
    double step = 0, wait = 0, train = 0, sync_wait = 0, sync = 0, syncs = 0;
    std::vector<double> sync_each;
    for (const auto& m : ms) {
      auto get = [&](const char* k) { return m.contains(k) && m[k].is_number() ? m[k].get<double>() : 0.0; };
      step += get("perf/step_s");
      wait += get("perf/rollout_wait_s");
      train += get("perf/fwd_bwd_s") + get("perf/recompute_s") + get("perf/optimizer_s");
      sync_wait += get("perf/weight_sync_wait_s");
      if (m.contains("perf/weight_sync_s")) {
        sync += get("perf/weight_sync_s");
        sync_each.push_back(get("perf/weight_sync_s") * 1e3);
        ++syncs;
      }
    }
    const double wall = ms.back()["time"].get<double>() - ms.front()["time"].get<double>() + ms.front()["perf/step_s"].get<double>();
    auto& v = by_transport[t];
    v["steps_per_s"] = static_cast<double>(ms.size()) / wall;
    v["generation_bound_share"] = wait / step;
    v["trainer_bound_share"] = train / step;
    v["sync_wait_share"] = sync_wait / step;
    v["sync_share_of_wall"] = sync / wall;
    v["sync_p50_ms"] = percentile(sync_each, 50);
    json cj = {{"transport", t}, {"steps", ms.size()}, {"syncs", syncs}, {"wall_s", wall}, {"demo_total_s", demo_s}};
    auto base = [&](const char* k) -> std::optional<double> {
      if (t == "path" || !by_transport.count("path")) return std::nullopt;
      return by_transport["path"][k];
    };
    rep.emit({"e2e", "steps_per_s", v["steps_per_s"], "steps/s", base("steps_per_s"), cj});
    rep.emit({"e2e", "generation_bound_share", v["generation_bound_share"], "fraction", std::nullopt, cj});
    rep.emit({"e2e", "trainer_bound_share", v["trainer_bound_share"], "fraction", std::nullopt, cj});
    rep.emit({"e2e", "sync_wait_share", v["sync_wait_share"], "fraction", base("sync_wait_share"), cj});
    rep.emit({"e2e", "sync_share_of_wall", v["sync_share_of_wall"], "fraction", base("sync_share_of_wall"), cj});
    rep.emit({"e2e", "sync_p50_ms", v["sync_p50_ms"], "ms", base("sync_p50_ms"), cj});
  }
  rep.print_table();
  return 0;
}

}  // namespace

void register_bench_e2e(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchE2eOptions>();
  auto r = std::make_shared<RaceOptions>();
  auto* sub = bench.add_subcommand(
      "e2e", "time to held-out accuracy: lorasync against TRL's async GRPO (same fleet) and TRL's GRPO (own generation); "
             "with --transports, the demo's run per sync transport");
  sub->add_option("--systems", r->systems, "lorasync, trl-async, trl-sync")->capture_default_str();
  sub->add_option("--seeds", r->seeds, "one run of each system per seed")->capture_default_str();
  sub->add_option("--budget-s", r->budget_s, "wall-time cap of each run (s)")->capture_default_str();
  sub->add_option("--max-steps", r->max_steps, "step cap of each run")->capture_default_str();
  sub->add_option("--target", r->target, "held-out accuracy to reach")->capture_default_str();
  sub->add_option("--save-steps", r->save_steps, "adapter snapshot (evaluated afterwards) every N steps")->capture_default_str();
  sub->add_option("--eval-problems", r->eval_problems, "held-out problems per evaluation")->capture_default_str();
  sub->add_option("--eval-samples", r->eval_samples, "samples per held-out problem")->capture_default_str();
  sub->add_option("--eval-temperature", r->eval_temperature, "sampling temperature of the evaluation")->capture_default_str();
  sub->add_option("--demo-dir", r->demo_dir, "a make-demo-model folder (default: the demo's cached model, made when missing)");
  sub->add_option("--model-seed", r->model_seed, "seed of the demo model")->capture_default_str();
  sub->add_option("--model-steps", r->model_steps, "SFT steps of the demo model when it is made (0 = default)")->capture_default_str();
  sub->add_option("--model", r->model, "any Hugging Face model directory instead of the demo's");
  sub->add_option("--train-data", r->train_data, "training problems (JSONL: problem, answer) instead of the demo's");
  sub->add_option("--heldout-data", r->heldout_data, "held-out problems instead of the demo's");
  sub->add_option("--system-prompt", r->system_prompt, "system prompt instead of the demo's");
  sub->add_option("--max-new-tokens", r->max_new_tokens, "completion cap instead of the demo's (0 = the demo's)");
  sub->add_option("--num-generations", r->num_generations, "group size G")->capture_default_str();
  sub->add_option("--samples-per-step", r->samples_per_step, "completions per optimizer step")->capture_default_str();
  sub->add_option("--lora-rank", r->lora_rank)->capture_default_str();
  sub->add_option("--lora-alpha", r->lora_alpha)->capture_default_str();
  sub->add_option("--lr", r->lr, "learning rate")->capture_default_str();
  sub->add_option("--temperature", r->temperature, "rollout temperature")->capture_default_str();
  sub->add_option("--max-staleness", r->max_staleness, "in weight syncs (TRL gets it in steps)")->capture_default_str();
  sub->add_option("--sync-every", r->sync_every, "optimizer steps between weight syncs")->capture_default_str();
  sub->add_option("--lorasync-old-policy", r->lorasync_old_policy, "grpo.old_policy of the lorasync runs")
      ->check(CLI::IsMember({"step_start", "recompute"}))
      ->capture_default_str();
  sub->add_option("--lorasync-set", r->lorasync_set, "KEY=VALUE passed to the lorasync runs' trainer as --set (repeatable)");
  sub->add_option("--python", r->python, "the interpreter with TRL (default: the project's .venv)");
  sub->add_option("--out", r->out, "report folder (report.json, summary.md, accuracy_vs_time.svg, runs/)")->capture_default_str();
  auto* tr = sub->add_option("--transports", o->transports, "instead: the demo per sync transport (path,push)");
  sub->add_option("--steps", o->steps, "with --transports: GRPO steps per run")->capture_default_str();
  sub->add_option("--seed", o->seed, "with --transports: the demo's seed")->capture_default_str();
  reg.add(sub, [o, r, tr] { return tr->count() ? run(*o) : run_race(*r); });
}

}  // namespace lorasync::cli
