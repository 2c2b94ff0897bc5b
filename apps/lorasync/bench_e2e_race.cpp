// `lorasync bench e2e`: time to accuracy, lorasync against TRL (bench_e2e_race.h).
//
// Per seed, one run of each system, one after the other on this machine:
//   lorasync   `lorasync train` through `lorasync proxy` in front of 2 `lorasync serve` replicas;
//   trl-async  TRL's AsyncGRPOTrainer (bench/trl_e2e.py --mode async) against the same fleet;
//   trl-sync   TRL's GRPOTrainer generating with transformers (bench/trl_e2e.py --mode sync).
// Every run snapshots its adapter every --save-steps steps, stamped with the wall time since its
// trainer process started; when all runs are over, each snapshot is evaluated on the held-out
// set by `lorasync eval` (in process, the same sampling for every system), which gives each run's
// curve of accuracy against wall time and the time it first reached --target. Evaluation is never
// part of a run's wall time. Writes OUT/report.json, OUT/summary.md and OUT/accuracy_vs_time.svg;
// prints the bench's JSON lines, with each system's time to target against lorasync's.
#include "bench_e2e_race.h"

#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <thread>

#include "demo/train_config.h"
#include "report/svg_chart.h"
#include "util/bench_report.h"
#include "util/supervised_process.h"
#include "util/error.h"
#include "util/files.h"
#include "util/json_lines.h"
#include "util/log.h"
#include "util/process.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

std::atomic<int> g_stop{0};
void on_signal(int s) { g_stop = s; }

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
double nan() { return std::nan(""); }

double num(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : nan();
}

std::string log_tail(const fs::path& p, std::size_t n = 3000) {
  std::string t = read_file(p);
  return t.size() > n ? t.substr(t.size() - n) : t;
}

// The task every system trains and is evaluated on.
struct Task {
  fs::path model, train, heldout;
  std::string system_prompt;
  std::int64_t max_new_tokens = 64;
};

struct Snapshot {
  std::int64_t step = 0;
  double t = 0;  // wall seconds since the run's trainer process started
  fs::path dir;
  double accuracy = std::nan("");
};

struct RunResult {
  std::string system;
  std::int64_t seed = 0;
  std::vector<Snapshot> snaps;
  std::int64_t steps = 0;
  double wall_s = 0;  // start to the last step's end
  double trained_tokens = 0;             // completion tokens that entered the loss
  double rollout_tok_s = std::nan("");   // generated tokens/s (median of the trainer's windowed rate)
  double wait_share = std::nan("");  // share of step time the trainer waited for rollouts or syncs
  double sync_p50_s = std::nan("");
  // Where the wall time went (seconds): start-up (process start to the first step's start), the
  // trainer's own compute (forward/backward, recompute, optimizer), waiting for rollouts, weight
  // syncs on the trainer's path; the rest is the loop (scoring, packing, logging, snapshots).
  double startup_s = std::nan(""), compute_s = std::nan(""), rollout_wait_s = std::nan(""), sync_s = std::nan("");
  double fleet_busy_share = std::nan("");  // the replicas' CPU time over their lifetime x 2 (1 compute thread each)
  std::map<std::string, double> rss_mb;
  double time_to_target = std::nan("");
  std::int64_t steps_to_target = -1;
  double final_accuracy = std::nan(""), best_accuracy = std::nan("");
};

// 2 replicas and the proxy (no authentication: loopback, one user).
struct Fleet {
  std::vector<std::unique_ptr<ChildProcess>> procs;
  std::string url;
  double started = unix_now();
  void check() {
    for (auto& p : procs)
      if (!p->alive()) throw_env("bench e2e: {} died ({}); see {}:\n{}", p->name(), p->status_text(), p->log().string(), log_tail(p->log()));
  }
  void stop(RunResult& r) {
    double replica_cpu = 0;
    int replicas = 0;
    for (auto it = procs.rbegin(); it != procs.rend(); ++it) {
      (*it)->stop(10);
      r.rss_mb[(*it)->name()] = (*it)->peak_rss_mb();
      if (starts_with((*it)->name(), "replica")) replica_cpu += (*it)->cpu_s(), ++replicas;
    }
    if (replicas) r.fleet_busy_share = replica_cpu / (replicas * std::max(1e-9, unix_now() - started));
  }
};

Fleet start_fleet(const std::string& exe, const fs::path& model, const std::string& served, const fs::path& adapter_root,
                  const fs::path& logs, std::int64_t max_loras, std::int64_t max_rank) {
  Fleet f;
  std::vector<std::string> upstreams;
  for (int i = 0; i < 2; ++i) {
    f.procs.push_back(std::make_unique<ChildProcess>(
        "replica" + std::to_string(i),
        std::vector<std::string>{exe, "serve", "--model", model.string(), "--served-model-name", served, "--port", "0", "--max-loras",
                                 std::to_string(max_loras), "--max-lora-rank", std::to_string(max_rank), "--max-model-len", "512",
                                 "--kv-cache-memory", "64MiB", "--allowed-adapter-root", adapter_root.string(), "--threads", "1",
                                 "--dtype", "float32"},
        logs, std::vector<std::string>{}, &g_stop));
  }
  for (auto& p : f.procs) upstreams.push_back("http://127.0.0.1:" + std::to_string(json::parse(p->first_line(120))["port"].get<int>()));
  std::vector<std::string> pargs = {exe, "proxy", "--listen", "127.0.0.1:0", "--threads", "1"};
  for (const auto& u : upstreams) pargs.insert(pargs.end(), {"--upstream", u});
  f.procs.push_back(std::make_unique<ChildProcess>("proxy", pargs, logs, std::vector<std::string>{}, &g_stop));
  f.url = "http://" + json::parse(f.procs.back()->first_line(60))["listening"].get<std::string>();
  return f;
}

// Step -> the unix time it ended, from a lorasync metrics.jsonl.
std::map<std::int64_t, double> step_times(const std::vector<json>& ms) {
  std::map<std::int64_t, double> out;
  for (const auto& m : ms)
    if (m.contains("step") && m.contains("time")) out[m["step"].get<std::int64_t>()] = m["time"].get<double>();
  return out;
}

class Race {
 public:
  Race(const RaceOptions& o, Task task) : o_(o), task_(std::move(task)), exe_(lorasync_executable()) {
    python_ = o.python.empty() ? std::string(LORASYNC_SOURCE_DIR) + "/.venv/bin/python" : o.python;
    driver_ = std::string(LORASYNC_SOURCE_DIR) + "/bench/trl_e2e.py";
  }

  RunResult run(const std::string& system, std::int64_t seed, const fs::path& dir) {
    fs::create_directories(dir / "logs");
    LS_LOG_INFO("bench", "bench e2e: {} seed {} (budget {:.0f} s, at most {} steps; logs in {})", system, seed, o_.budget_s,
                o_.max_steps, (dir / "logs").string());
    RunResult r = system == "lorasync" ? run_lorasync(seed, dir) : run_trl(system, seed, dir);
    r.system = system;
    r.seed = seed;
    std::sort(r.snaps.begin(), r.snaps.end(), [](const Snapshot& a, const Snapshot& b) { return a.step < b.step; });
    if (r.snaps.empty()) throw_env("bench e2e: the {} run (seed {}) left no adapter snapshot in {}", system, seed, dir.string());
    return r;
  }

  // Held-out accuracy of one adapter (or of the base model when dir is empty).
  double evaluate(const fs::path& adapter, const fs::path& logs, const std::string& tag) {
    std::vector<std::string> args = {exe_, "eval", "--model", task_.model.string(), "--data", task_.heldout.string(), "--samples",
                                     std::to_string(o_.eval_samples), "--temperature", fmt::format("{}", o_.eval_temperature),
                                     "--max-new-tokens", std::to_string(task_.max_new_tokens), "--limit", std::to_string(o_.eval_problems),
                                     "--seed", "7", "--system-prompt", task_.system_prompt, "--threads", "0",
                                     "--out", (logs / ("eval-" + tag + ".json")).string()};
    if (!adapter.empty()) args.insert(args.end(), {"--adapter", adapter.string()});
    ChildProcess c("eval-" + tag, args, logs, {}, &g_stop);
    const int code = c.wait();
    if (g_stop) throw Error(ErrorKind::kUnavailable, "interrupted");
    if (code != 0) throw_env("bench e2e: evaluating {} failed ({}):\n{}", adapter.string(), c.status_text(), log_tail(c.log()));
    return json::parse(read_file(logs / ("eval-" + tag + ".json"))).at("accuracy").get<double>();
  }

 private:
  // Waits for a trainer, stopping it (SIGTERM, then the kill) once the budget is spent.
  void supervise(ChildProcess& trainer, double t0, Fleet* fleet, double grace_s) {
    bool termed = false;
    while (trainer.alive()) {
      if (g_stop) {
        trainer.stop(10);
        throw Error(ErrorKind::kUnavailable, "interrupted");
      }
      if (fleet) fleet->check();
      const double used = unix_now() - t0;
      if (!termed && used > o_.budget_s + grace_s) {
        LS_LOG_INFO("bench", "bench e2e: {} is past its budget; stopping it", trainer.name());
        trainer.signal(SIGTERM);
        termed = true;
      } else if (termed && used > o_.budget_s + grace_s + 60) {
        trainer.stop(1);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    if (trainer.code() != 0 && !termed)
      throw_env("bench e2e: {} exited with {}; see {}:\n{}", trainer.name(), trainer.status_text(), trainer.log().string(),
                log_tail(trainer.log()));
  }

  RunResult run_lorasync(std::int64_t seed, const fs::path& dir) {
    RunResult r;
    const fs::path logs = dir / "logs";
    Fleet fleet = start_fleet(exe_, task_.model, "demo-base", dir, logs, o_.max_staleness + 3, o_.lora_rank);
    demo::DemoTrainSettings ts;
    ts.output_dir = (dir / "run").string();
    ts.seed = seed;
    ts.max_steps = o_.max_steps;
    ts.model_path = task_.model.string();
    ts.train_file = task_.train.string();
    ts.system_prompt = task_.system_prompt;
    ts.server_url = fleet.url;
    ts.max_new_tokens = task_.max_new_tokens;
    ts.temperature = o_.temperature;
    ts.num_generations = o_.num_generations;
    ts.samples_per_step = o_.samples_per_step;
    ts.lora_rank = o_.lora_rank;
    ts.lora_alpha = o_.lora_alpha;
    ts.lr = o_.lr;
    ts.max_staleness = o_.max_staleness;
    ts.sync_every = o_.sync_every;
    ts.old_policy = o_.lorasync_old_policy;
    ts.save_steps = o_.save_steps;
    ts.save_total_limit = 1000000;  // every snapshot is evaluated afterwards
    write_file_atomic(dir / "train.toml", demo::demo_train_toml(ts));
    const double t0 = unix_now();
    std::vector<std::string> targs = {exe_, "train", "--config", (dir / "train.toml").string()};
    for (const auto& kv : o_.lorasync_set) targs.insert(targs.end(), {"--set", kv});
    ChildProcess trainer("trainer", targs, logs, {}, &g_stop);
    supervise(trainer, t0, &fleet, 0);
    fleet.stop(r);
    r.rss_mb["trainer"] = trainer.peak_rss_mb();
    const auto ms = read_jsonl(dir / "run" / "metrics.jsonl");
    if (ms.empty()) throw_env("bench e2e: the lorasync run wrote no metrics; see {}", trainer.log().string());
    const auto times = step_times(ms);
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir / "run" / "checkpoints", ec)) {
      const std::string n = e.path().filename().string();
      if (!starts_with(n, "step-") || !fs::exists(e.path() / "adapter")) continue;
      const std::int64_t step = std::stoll(n.substr(5));
      if (auto it = times.find(step); it != times.end()) r.snaps.push_back({step, it->second - t0, e.path() / "adapter"});
    }
    const std::int64_t last = ms.back().value("step", std::int64_t{0});
    const bool have_last = std::any_of(r.snaps.begin(), r.snaps.end(), [&](const Snapshot& s) { return s.step == last; });
    if (!have_last && fs::exists(dir / "run" / "final_adapter") && times.count(last))
      r.snaps.push_back({last, times.at(last) - t0, dir / "run" / "final_adapter"});
    double step_s = 0, wait_s = 0, compute = 0, rollout_wait = 0, sync_wait = 0;
    std::vector<double> gen_rates;
    std::vector<double> syncs;
    auto add = [](double& acc, double v) {
      if (std::isfinite(v)) acc += v;
    };
    for (const auto& m : ms) {
      for (const char* k : {"perf/fwd_bwd_s", "perf/recompute_s", "perf/optimizer_s"}) add(compute, num(m, k));
      add(rollout_wait, num(m, "perf/rollout_wait_s"));
      add(sync_wait, num(m, "perf/weight_sync_wait_s"));
      const double spp = num(m, "batch/samples_per_step"), len = num(m, "completions/mean_length");
      if (std::isfinite(spp) && std::isfinite(len)) r.trained_tokens += spp * len;
      if (std::isfinite(num(m, "rollout/generated_tok_s"))) gen_rates.push_back(num(m, "rollout/generated_tok_s"));
      if (std::isfinite(num(m, "perf/step_s"))) step_s += num(m, "perf/step_s");
      for (const char* k : {"perf/rollout_wait_s", "perf/weight_sync_wait_s"})
        if (std::isfinite(num(m, k))) wait_s += num(m, k);
      if (std::isfinite(num(m, "perf/weight_sync_s"))) syncs.push_back(num(m, "perf/weight_sync_s"));
    }
    r.steps = static_cast<std::int64_t>(ms.size());
    r.wall_s = times.rbegin()->second - t0;
    r.compute_s = compute;
    if (!gen_rates.empty()) r.rollout_tok_s = percentile(gen_rates, 50);
    r.rollout_wait_s = rollout_wait;
    r.sync_s = sync_wait;
    r.startup_s = times.begin()->second - t0 - (std::isfinite(num(ms.front(), "perf/step_s")) ? num(ms.front(), "perf/step_s") : 0.0);
    if (step_s > 0) r.wait_share = wait_s / step_s;
    if (!syncs.empty()) r.sync_p50_s = percentile(syncs, 50);
    return r;
  }

  RunResult run_trl(const std::string& system, std::int64_t seed, const fs::path& dir) {
    RunResult r;
    const fs::path logs = dir / "logs";
    const bool async = system == "trl-async";
    // The model as TRL loads it: the same files, with Qwen2.5's chat template (the one TRL's
    // rollout worker recognises); the driver checks it renders the prompts lorasync trains on.
    {
      ChildProcess prep("prepare-model",
                        {python_, driver_, "--prepare-model", task_.model.string(), "--output-dir", dir.string(), "--data",
                         task_.train.string(), "--system-prompt", task_.system_prompt, "--mode", async ? "async" : "sync"},
                        logs, {}, &g_stop);
      if (prep.wait() != 0) throw_env("bench e2e: preparing the model for TRL failed:\n{}", log_tail(prep.log()));
    }
    const fs::path model = dir / "model";
    std::unique_ptr<Fleet> fleet;
    // TRL names the base model by the path it loaded (vLLM's default served name is that path too).
    if (async) fleet = std::make_unique<Fleet>(start_fleet(exe_, model, model.string(), dir, logs, o_.max_staleness * o_.sync_every + 3, o_.lora_rank));
    std::vector<std::string> args = {
        python_, driver_, "--mode", async ? "async" : "sync", "--model", model.string(), "--data", task_.train.string(),
        "--system-prompt", task_.system_prompt, "--output-dir", dir.string(), "--seed", std::to_string(seed),
        "--num-generations", std::to_string(o_.num_generations), "--samples-per-step", std::to_string(o_.samples_per_step),
        "--lr", fmt::format("{}", o_.lr), "--lora-rank", std::to_string(o_.lora_rank), "--lora-alpha", fmt::format("{}", o_.lora_alpha),
        "--max-completion-length", std::to_string(task_.max_new_tokens), "--temperature", fmt::format("{}", o_.temperature),
        "--max-staleness", std::to_string(o_.max_staleness * o_.sync_every), "--weight-sync-steps", std::to_string(o_.sync_every),
        "--max-steps", std::to_string(o_.max_steps), "--max-seconds", fmt::format("{}", o_.budget_s), "--save-steps",
        std::to_string(o_.save_steps)};
    if (async) args.insert(args.end(), {"--server", fleet->url});
    ChildProcess trainer("trl-" + std::string(async ? "async" : "sync"), args, logs, {"PYTHONUNBUFFERED=1"}, &g_stop);
    const double t_fork = unix_now();
    // The driver stops itself at the budget after a step; the bench only steps in when a step overruns.
    supervise(trainer, t_fork, fleet.get(), 120);
    if (fleet) fleet->stop(r);
    r.rss_mb["trainer"] = trainer.peak_rss_mb();
    const auto tl = read_jsonl(dir / "timeline.jsonl");
    double t0 = t_fork, last_t = nan(), first_t = nan(), first_step_s = 0;
    double step_s = 0, wait_s = 0, compute = 0, sync = 0;
    std::vector<double> gen_rates;
    std::vector<double> syncs;
    for (const auto& e : tl) {
      const std::string ev = e.value("event", std::string());
      if (ev == "start") t0 = e.at("time").get<double>();
      if (ev == "adapter") r.snaps.push_back({e.at("step").get<std::int64_t>(), e.at("time").get<double>() - t0, fs::path(e.at("dir").get<std::string>())});
      if (ev != "log" || !e.contains("loss")) continue;  // a training step's log
      r.steps = std::max(r.steps, e.value("step", std::int64_t{0}));
      last_t = e.at("time").get<double>();
      if (!std::isfinite(first_t)) {
        first_t = last_t;
        // TRL's first log has no perf/step_s; GRPOTrainer logs step_time.
        for (const char* k : {"perf/step_s", "step_time"})
          if (std::isfinite(num(e, k))) first_step_s = num(e, k);
      }
      for (const char* k : {"perf/fwd_bwd_s", "perf/optimizer_s"})
        if (std::isfinite(num(e, k))) compute += num(e, k);
      if (std::isfinite(num(e, "perf/weight_sync_s"))) sync += num(e, "perf/weight_sync_s");
      const double len = num(e, "completions/mean_length");
      const double spp = num(e, "batch/samples_per_step");  // async; GRPOTrainer trains --samples-per-step
      if (std::isfinite(len)) r.trained_tokens += len * (std::isfinite(spp) ? spp : static_cast<double>(o_.samples_per_step));
      if (std::isfinite(num(e, "rollout/generated_tok_s"))) gen_rates.push_back(num(e, "rollout/generated_tok_s"));
      if (std::isfinite(num(e, "perf/step_s"))) step_s += num(e, "perf/step_s");
      if (std::isfinite(num(e, "perf/rollout_wait_s"))) wait_s += num(e, "perf/rollout_wait_s");
      if (std::isfinite(num(e, "perf/weight_sync_s"))) syncs.push_back(num(e, "perf/weight_sync_s"));
    }
    if (r.steps == 0) throw_env("bench e2e: the {} run logged no training step; see {}:\n{}", system, trainer.log().string(), log_tail(trainer.log()));
    r.wall_s = last_t - t0;
    // GRPOTrainer generates exactly what it trains, inside its steps.
    r.rollout_tok_s = gen_rates.empty() ? r.trained_tokens / r.wall_s : percentile(gen_rates, 50);
    r.startup_s = first_t - t0 - first_step_s;
    if (async) {  // the synchronous trainer logs no split of its step (generation is inside it)
      r.compute_s = compute;
      r.rollout_wait_s = wait_s;
      r.sync_s = sync;
    }
    if (step_s > 0) r.wait_share = wait_s / step_s;
    if (!syncs.empty()) r.sync_p50_s = percentile(syncs, 50);
    return r;
  }

  const RaceOptions& o_;
  Task task_;
  std::string exe_, python_, driver_;
};

Task resolve_task(const RaceOptions& o, const fs::path& logs) {
  Task t;
  fs::path demo_dir = o.demo_dir;
  if (demo_dir.empty() && (o.model.empty() || o.train_data.empty() || o.heldout_data.empty())) {
    demo_dir = demo::cached_model_dir(demo::default_cache_dir(), o.model_seed, o.model_steps);
  }
  json meta = json::object();
  if (!demo_dir.empty()) {
    if (!fs::exists(demo_dir / "demo.json")) {
      LS_LOG_INFO("bench", "bench e2e: making the demo model in {}", demo_dir.string());
      fs::create_directories(demo_dir.parent_path());
      std::vector<std::string> args = {lorasync_executable(), "make-demo-model", "--out", demo_dir.string(), "--seed", std::to_string(o.model_seed)};
      if (o.model_steps > 0) args.insert(args.end(), {"--steps", std::to_string(o.model_steps)});
      ChildProcess c("make-demo-model", args, logs, {}, &g_stop);
      if (c.wait() != 0) throw_env("bench e2e: make-demo-model failed:\n{}", log_tail(c.log()));
    }
    meta = json::parse(read_file(demo_dir / "demo.json"));
    t.model = demo_dir / meta.value("model_dir", std::string("model"));
    t.train = demo_dir / meta.value("train_file", std::string("train.jsonl"));
    t.heldout = demo_dir / meta.value("heldout_file", std::string("heldout.jsonl"));
    t.system_prompt = meta.value("system_prompt", std::string());
    t.max_new_tokens = meta.value("max_new_tokens", std::int64_t{64});
  }
  if (!o.model.empty()) t.model = o.model;
  if (!o.train_data.empty()) t.train = o.train_data;
  if (!o.heldout_data.empty()) t.heldout = o.heldout_data;
  if (!o.system_prompt.empty()) t.system_prompt = o.system_prompt;
  if (o.max_new_tokens > 0) t.max_new_tokens = o.max_new_tokens;
  for (const auto& [what, p] : {std::pair{"--model", t.model}, {"--train-data", t.train}, {"--heldout-data", t.heldout}})
    if (!fs::exists(p)) throw_invalid("bench e2e: {} {} does not exist", what, p.string());
  t.model = fs::absolute(t.model);
  t.train = fs::absolute(t.train);
  t.heldout = fs::absolute(t.heldout);
  return t;
}

void score(RunResult& r, double target) {
  for (const auto& s : r.snaps) {
    if (!std::isfinite(s.accuracy) || s.step == 0) continue;  // the base model is not a result of the run
    r.best_accuracy = std::isfinite(r.best_accuracy) ? std::max(r.best_accuracy, s.accuracy) : s.accuracy;
    if (r.steps_to_target < 0 && s.accuracy >= target) {
      r.time_to_target = s.t;
      r.steps_to_target = s.step;
    }
  }
  r.final_accuracy = r.snaps.back().accuracy;
}

double median(std::vector<double> v) {
  if (v.empty()) return nan();
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

json run_json(const RunResult& r) {
  json curve = json::array();
  for (const auto& s : r.snaps) curve.push_back({{"step", s.step}, {"t", s.t}, {"accuracy", s.accuracy}});
  auto f = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
  return {{"system", r.system}, {"seed", r.seed}, {"steps", r.steps}, {"wall_s", r.wall_s}, {"curve", curve},
          {"time_to_target_s", f(r.time_to_target)}, {"steps_to_target", r.steps_to_target},
          {"final_accuracy", f(r.final_accuracy)}, {"best_accuracy", f(r.best_accuracy)},
          {"trained_tokens_per_s", f(r.trained_tokens / r.wall_s)}, {"rollout_tokens_per_s", f(r.rollout_tok_s)},
          {"s_per_step", f(r.wall_s / static_cast<double>(std::max<std::int64_t>(1, r.steps)))},
          {"trainer_wait_share", f(r.wait_share)}, {"sync_p50_s", f(r.sync_p50_s)}, {"peak_rss_mb", r.rss_mb},
          {"wall_breakdown_s", {{"startup", f(r.startup_s)}, {"trainer_compute", f(r.compute_s)}, {"rollout_wait", f(r.rollout_wait_s)},
                                {"weight_sync", f(r.sync_s)},
                                {"loop_other", f(r.wall_s - r.startup_s - r.compute_s - r.rollout_wait_s - r.sync_s)}}},
          {"fleet_busy_share", f(r.fleet_busy_share)}};
}

}  // namespace

int run_race(const RaceOptions& o) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  const std::vector<std::string> systems = split(o.systems, ',');
  for (const auto& s : systems)
    if (s != "lorasync" && s != "trl-async" && s != "trl-sync") throw_invalid("--systems takes lorasync, trl-async and trl-sync, got '{}'", s);
  std::vector<std::int64_t> seeds;
  for (const auto& s : split(o.seeds, ',')) {
    try {
      seeds.push_back(std::stoll(s));
    } catch (const std::exception&) {
      throw_invalid("--seeds: '{}' is not a number", s);
    }
  }
  if (seeds.empty()) throw_invalid("--seeds is empty");
  if (o.save_steps <= 0 || o.budget_s <= 0 || o.max_steps <= 0) throw_invalid("--save-steps, --budget-s and --max-steps must be positive");
  const fs::path out = fs::absolute(o.out);
  fs::create_directories(out / "logs");
  const Task task = resolve_task(o, out / "logs");
  Race race(o, task);
  const double base_acc = race.evaluate({}, out / "logs", "base");
  LS_LOG_INFO("bench", "bench e2e: base model held-out accuracy {:.3f} (target {:.3f})", base_acc, o.target);

  std::vector<RunResult> runs;
  for (auto seed : seeds)
    for (const auto& sys : systems) {
      const fs::path dir = out / "runs" / (sys + "-seed" + std::to_string(seed));
      fs::remove_all(dir);
      runs.push_back(race.run(sys, seed, dir));
    }
  // Evaluation, after every run (never inside a run's wall time).
  for (auto& r : runs) {
    for (auto& s : r.snaps)
      s.accuracy = race.evaluate(s.dir, out / "runs" / (r.system + "-seed" + std::to_string(r.seed)) / "logs", "step" + std::to_string(s.step));
    r.snaps.insert(r.snaps.begin(), Snapshot{0, 0.0, {}, base_acc});
    score(r, o.target);
    LS_LOG_INFO("bench", "bench e2e: {} seed {}: {} steps in {:.0f} s, final accuracy {:.3f}, target {}", r.system, r.seed, r.steps,
                r.wall_s, r.final_accuracy,
                std::isfinite(r.time_to_target) ? fmt::format("reached at {:.0f} s (step {})", r.time_to_target, r.steps_to_target)
                                                : std::string("not reached"));
  }

  // Per system: the median over seeds (a seed that never reached the target counts as the budget,
  // and the figure is then a lower bound).
  BenchReporter rep;
  json report = {{"format_version", 1}, {"target", o.target}, {"base_accuracy", base_acc}, {"budget_s", o.budget_s},
                 {"max_steps", o.max_steps}, {"seeds", seeds}, {"systems", systems},
                 {"task", {{"model", task.model.string()}, {"train", task.train.string()}, {"heldout", task.heldout.string()},
                           {"eval_problems", o.eval_problems}, {"eval_samples", o.eval_samples}, {"eval_temperature", o.eval_temperature},
                           {"max_new_tokens", task.max_new_tokens}}},
                 {"hyperparameters", {{"num_generations", o.num_generations}, {"samples_per_step", o.samples_per_step},
                                      {"lora_rank", o.lora_rank}, {"lora_alpha", o.lora_alpha}, {"lr", o.lr},
                                      {"temperature", o.temperature}, {"max_staleness_syncs", o.max_staleness},
                                      {"sync_every_steps", o.sync_every}, {"save_steps", o.save_steps},
                                      {"lorasync_old_policy", o.lorasync_old_policy}, {"lorasync_set", o.lorasync_set}}},
                 {"runs", json::array()}, {"systems_summary", json::object()}};
  for (const auto& r : runs) report["runs"].push_back(run_json(r));
  std::map<std::string, double> ttt;
  for (const auto& sys : systems) {
    std::vector<double> t, fin, tps, cps, spp;
    int reached = 0;
    for (const auto& r : runs) {
      if (r.system != sys) continue;
      reached += std::isfinite(r.time_to_target) ? 1 : 0;
      t.push_back(std::isfinite(r.time_to_target) ? r.time_to_target : std::max(o.budget_s, r.wall_s));
      fin.push_back(r.final_accuracy);
      tps.push_back(r.trained_tokens / r.wall_s);
      cps.push_back(r.rollout_tok_s);
      spp.push_back(r.wall_s / static_cast<double>(std::max<std::int64_t>(1, r.steps)));
    }
    ttt[sys] = median(t);
    const bool bound = reached < static_cast<int>(t.size());  // a run that never got there counts its whole wall time
    report["systems_summary"][sys] = {{"time_to_target_s_median", ttt[sys]}, {"reached", reached}, {"runs", t.size()},
                                      {"median_is_lower_bound", bound}, {"final_accuracy_median", median(fin)},
                                      {"trained_tokens_per_s_median", median(tps)}, {"rollout_tokens_per_s_median", median(cps)},
                                      {"s_per_step_median", median(spp)}};
    const json cj = {{"system", sys}, {"seeds", seeds.size()}, {"reached", reached}, {"target", o.target}};
    const std::optional<double> lb = sys == "lorasync" || !ttt.count("lorasync") ? std::nullopt : std::optional<double>(ttt["lorasync"]);
    // The ratio column is this system's time over lorasync's: how many times sooner lorasync gets there.
    rep.emit({"e2e", "time_to_target_s", ttt[sys], "s", lb, cj});
    rep.emit({"e2e", "final_accuracy", median(fin), "accuracy", std::nullopt, cj});
    rep.emit({"e2e", "s_per_step", median(spp), "s", std::nullopt, cj});
    rep.emit({"e2e", "trained_tokens_per_s", median(tps), "tokens/s", std::nullopt, cj});
    rep.emit({"e2e", "rollout_tokens_per_s", median(cps), "tokens/s", std::nullopt, cj});
  }
  write_file_atomic(out / "report.json", report.dump(1));

  // The plot: held-out accuracy against wall time, one line per run, a colour per system.
  report::ChartOptions co;
  co.title = fmt::format("held-out accuracy against wall time (target {:.2f})", o.target);
  co.x_label = "wall time since the trainer started (s)";
  co.y_label = "held-out accuracy";
  co.x_integer = false;
  co.width = 760;
  co.height = 360;
  report::LineChart chart(co);
  const std::map<std::string, std::string> colour = {{"lorasync", "#1f77b4"}, {"trl-async", "#ff7f0e"}, {"trl-sync", "#2ca02c"}};
  for (const auto& r : runs) {
    report::Series s;
    s.name = r.system + " seed " + std::to_string(r.seed);
    s.color = colour.at(r.system);
    s.dashed = r.seed != seeds.front();
    for (const auto& p : r.snaps) s.x.push_back(p.t), s.y.push_back(p.accuracy);
    chart.add_series(std::move(s));
  }
  chart.add_reference(o.target, "target");
  write_file_atomic(out / "accuracy_vs_time.svg", chart.to_svg());

  std::string md = fmt::format("# bench e2e: time to held-out accuracy {:.2f} (base model {:.3f})\n\n", o.target, base_acc);
  md += "| system | seed | steps | wall s | s/step | time to target s | steps to target | final acc | best acc | trained tok/s | rollout tok/s | "
        "trainer wait share | sync p50 s | peak RSS MiB (trainer / largest replica) |\n";
  md += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : runs) {
    double replica = 0;
    for (const auto& [name, mb] : r.rss_mb)
      if (starts_with(name, "replica")) replica = std::max(replica, mb);
    md += fmt::format("| {} | {} | {} | {:.1f} | {:.3f} | {} | {} | {:.3f} | {:.3f} | {:.0f} | {:.0f} | {:.2f} | {:.3f} | {:.0f} / {} |\n", r.system, r.seed,
                      r.steps, r.wall_s, r.wall_s / static_cast<double>(std::max<std::int64_t>(1, r.steps)),
                      std::isfinite(r.time_to_target) ? fmt::format("{:.1f}", r.time_to_target) : std::string("not reached"),
                      r.steps_to_target, r.final_accuracy, r.best_accuracy, r.trained_tokens / r.wall_s, r.rollout_tok_s, r.wait_share,
                      r.sync_p50_s, r.rss_mb.count("trainer") ? r.rss_mb.at("trainer") : 0.0,
                      replica > 0 ? fmt::format("{:.0f}", replica) : std::string("-"));
  }
  md += "\nWhere each run's wall time went (s; `-`: not logged by that trainer):\n\n| system | seed | start-up | trainer compute | rollout wait | weight sync | loop, other | fleet busy share |\n|---|---|---|---|---|---|---|---|\n";
  auto cell = [](double v) { return std::isfinite(v) ? fmt::format("{:.1f}", v) : std::string("-"); };
  for (const auto& r : runs)
    md += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} |\n", r.system, r.seed, cell(r.startup_s), cell(r.compute_s), cell(r.rollout_wait_s),
                      cell(r.sync_s), cell(r.wall_s - r.startup_s - r.compute_s - r.rollout_wait_s - r.sync_s),
                      std::isfinite(r.fleet_busy_share) ? fmt::format("{:.2f}", r.fleet_busy_share) : std::string("-"));
  md += "\n| system | median time to target s | reached | x lorasync's time |\n|---|---|---|---|\n";
  for (const auto& sys : systems)
    md += fmt::format("| {} | {:.1f}{} | {}/{} | {:.2f} |\n", sys, ttt[sys],
                      report["systems_summary"][sys]["median_is_lower_bound"].get<bool>() ? " (lower bound)" : "",
                      report["systems_summary"][sys]["reached"].get<int>(), seeds.size(),
                      ttt.count("lorasync") ? ttt[sys] / ttt["lorasync"] : nan());
  write_file_atomic(out / "summary.md", md);
  rep.print_table();
  std::fprintf(stderr, "%s\nreport: %s, %s\n", md.c_str(), (out / "report.json").string().c_str(), (out / "accuracy_vs_time.svg").string().c_str());
  return 0;
}

}  // namespace lorasync::cli
