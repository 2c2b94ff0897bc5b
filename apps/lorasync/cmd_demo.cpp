// `lorasync demo`: the embedded default (demo.md). The whole system on one machine, as separate
// processes talking the same HTTP and bucket protocols as across machines: a tiny base model (made
// once by `lorasync make-demo-model` and cached), 2 `lorasync serve` replicas, `lorasync proxy`
// (inbound API key + upstream token), `lorasync train` with LoRA through the proxy and a bucket
// directory under the run folder, then `lorasync eval` of the base model and the final adapter on
// held-out problems, a summary table, summary.json / eval.json and report.html (+ plots/*.svg).
//
// Supervision: children get free ports (port 0, read back from their first stdout line), logs in
// the run folder, their own process group (Ctrl-C reaches the demo, which stops the trainer first
// so it checkpoints, then the fleet) and PR_SET_PDEATHSIG (they die with the demo). A child that
// dies unexpectedly stops the demo with its name, exit status and log path. `--resume` continues an
// interrupted run from the trainer's last checkpoint with a fresh fleet.
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "demo/quality.h"
#include "demo/train_config.h"
#include "http/blocking_client.h"
#include "report/report.h"
#include "util/supervised_process.h"
#include "util/error.h"
#include "util/files.h"
#include "util/json_lines.h"
#include "util/process.h"

namespace lorasync::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::atomic<int> g_signal{0};
void on_signal(int s) { g_signal = s; }

double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

std::string random_token() { return random_hex(16); }

// A supervised child process (util/supervised_process.h) that the demo's Ctrl-C interrupts.
class Child : public ChildProcess {
 public:
  Child(std::string name, std::vector<std::string> argv, const fs::path& dir, std::vector<std::string> env = {})
      : ChildProcess(std::move(name), std::move(argv), dir, std::move(env), &g_signal) {}
  json first_json(double timeout_s) { return json::parse(first_line(timeout_s)); }
};

// Runs a command to completion (logs in the run folder); throws with the log path on failure.
json run_step(const std::string& name, std::vector<std::string> argv, const fs::path& dir, std::vector<std::string> env = {}) {
  Child c(name, std::move(argv), dir, std::move(env));
  const int code = c.wait();
  if (g_signal) throw Error(ErrorKind::kUnavailable, "interrupted");
  if (code != 0) {
    std::string tail = read_file(c.log());
    if (tail.size() > 800) tail = tail.substr(tail.size() - 800);
    throw Error(ErrorKind::kUnavailable, name + " failed (" + c.status_text() + "); log " + c.log().string() + ":\n" + tail);
  }
  std::ifstream f(c.out());
  std::string line, last;
  while (std::getline(f, line))
    if (!line.empty()) last = line;
  return last.empty() ? json::object() : json::parse(last, nullptr, false);
}

// One loopback call (status 0 on a transport failure).
int http_call(std::uint16_t port, const std::string& method, const std::string& path, const std::string& body,
              const std::string& bearer, std::string* out) {
  http::BlockingClient c("http://127.0.0.1:" + std::to_string(port), bearer);
  auto r = c.request(method, path, body, 60, true);
  if (out) *out = r.status ? r.body : r.message;
  return r.status;
}

std::string get_text(std::uint16_t port, const std::string& path, const std::string& bearer) {
  std::string out;
  return http_call(port, "GET", path, "", bearer, &out) == 200 ? out : std::string();
}

double prom_value(const std::string& text, const std::string& name) {
  const auto pos = text.find("\n" + name + " ");
  if (pos == std::string::npos) return std::nan("");
  return std::strtod(text.c_str() + pos + name.size() + 2, nullptr);
}

double mean_of(const std::vector<json>& ms, const char* key, std::size_t from, std::size_t to) {
  double s = 0;
  int n = 0;
  for (std::size_t i = from; i < to && i < ms.size(); ++i)
    if (ms[i].contains(key) && ms[i][key].is_number()) s += ms[i][key].get<double>(), ++n;
  return n ? s / n : std::nan("");
}

struct DemoOptions {
  std::string run_dir = "runs/demo";
  std::string cache_dir;  // default: $XDG_CACHE_HOME/lorasync or ~/.cache/lorasync
  bool resume = false;
  std::int64_t steps = 160;
  std::int64_t eval_problems = 200;
  std::int64_t eval_samples = 2;
  std::int64_t seed = 1;
  std::int64_t model_steps = 0;
  std::string arch = "qwen2";  // the base model's family
  double lr = 5e-4;
  std::int64_t max_staleness = 2;  // SFT steps of the base model (0 = make-demo-model's default)
  std::string device = "cpu";      // replicas and trainer: cpu or cuda[:N] (fp32 either way)
  std::string sync_transport = "auto";  // the trainer's sync.transport
  demo::QualityBar bar;                 // checked at the end: exit 3 when missed
};

std::string progress_bar(double frac, int width) {
  const int n = static_cast<int>(std::clamp(frac, 0.0, 1.0) * width);
  return std::string(static_cast<std::size_t>(n), '#') + std::string(static_cast<std::size_t>(width - n), '.');
}

int run_demo(const DemoOptions& o) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  const double t_start = now_s();
  const std::string exe = lorasync_executable();  // the front: the proxy child then runs without libtorch
  const bool tty = ::isatty(2) != 0;
  auto say = [&](const std::string& s) {
    std::fprintf(stderr, "%s\n", s.c_str());
    std::fflush(stderr);
  };

  // 1. The base model (cached).
  const fs::path cache = o.cache_dir.empty() ? demo::default_cache_dir() : fs::path(o.cache_dir);
  const fs::path base = demo::cached_model_dir(cache, o.seed, o.model_steps, o.arch);
  const fs::path run = fs::absolute(o.run_dir);
  if (!o.resume && fs::exists(run)) fs::remove_all(run);
  fs::create_directories(run / "logs");
  const fs::path logs = run / "logs";
  double model_s = 0;
  if (!fs::exists(base / "demo.json")) {
    say("[1/6] making the demo base model (synthetic maths task, small BPE tokenizer, supervised warm-up); cached in " +
        base.string());
    const double t0 = now_s();
    fs::create_directories(cache);
    std::vector<std::string> margs = {exe, "make-demo-model", "--out", base.string(), "--seed", std::to_string(o.seed)};
    if (o.model_steps > 0) margs.insert(margs.end(), {"--steps", std::to_string(o.model_steps)});
    margs.insert(margs.end(), {"--arch", o.arch});
    run_step("make-demo-model", margs, logs);
    model_s = now_s() - t0;
    say(fmt::format("      done in {:.0f} s", model_s));
  } else {
    say("[1/6] demo base model: cached at " + base.string());
  }
  const json meta = json::parse(read_file(base / "demo.json"));
  const std::string system_prompt = meta.value("system_prompt", std::string());
  const std::int64_t max_new = meta.value("max_new_tokens", std::int64_t{64});

  // 2. The fleet: 2 replicas (upstream token) + the proxy (inbound API key).
  const std::string upstream_token = random_token(), api_key = random_token();
  const fs::path bucket = run / "bucket";
  fs::create_directories(bucket);
  std::vector<std::string> tok_env = {"LORASYNC_DEMO_UPSTREAM_TOKEN=" + upstream_token, "LORASYNC_DEMO_API_KEY=" + api_key};
  say("[2/6] starting 2 lorasync serve replicas and lorasync proxy (logs in " + logs.string() + ")");
  std::vector<std::unique_ptr<Child>> fleet;
  std::vector<std::uint16_t> ports;
  for (int i = 0; i < 2; ++i) {
    fleet.push_back(std::make_unique<Child>(
        "replica" + std::to_string(i),
        std::vector<std::string>{exe, "serve", "--model", (base / "model").string(), "--served-model-name", "demo-base", "--port", "0",
                                 "--api-key", upstream_token, "--max-loras", "6", "--max-lora-rank", "8", "--max-model-len", "512",
                                 "--kv-cache-memory", "64MiB", "--allowed-adapter-root", run.string(), "--threads", "1",
                                 "--device", o.device, "--dtype", "float32"},
        logs));
  }
  for (auto& c : fleet) ports.push_back(static_cast<std::uint16_t>(c->first_json(60)["port"].get<int>()));
  fleet.push_back(std::make_unique<Child>(
      "proxy",
      std::vector<std::string>{exe, "proxy", "--listen", "127.0.0.1:0", "--upstream", "http://127.0.0.1:" + std::to_string(ports[0]),
                               "--upstream", "http://127.0.0.1:" + std::to_string(ports[1]), "--upstream-token-env",
                               "LORASYNC_DEMO_UPSTREAM_TOKEN", "--api-key-env", "LORASYNC_DEMO_API_KEY", "--threads", "1"},
      logs, tok_env));
  const std::string listen = fleet.back()->first_json(30)["listening"].get<std::string>();
  const auto proxy_port = static_cast<std::uint16_t>(std::stoi(listen.substr(listen.rfind(':') + 1)));
  const std::string url = "http://" + listen;
  auto check_fleet = [&] {
    for (auto& c : fleet)
      if (!c->alive())
        throw Error(ErrorKind::kUnavailable, c->name() + " died (" + c->status_text() + "); see " + c->log().string());
  };
  say(fmt::format("      replicas on ports {} and {}, proxy on {}", ports[0], ports[1], listen));

  auto eval = [&](const std::string& model_name, const std::string& tag) {
    return run_step("eval-" + tag,
                    {exe, "eval", "--data", (base / "heldout.jsonl").string(), "--model", (base / "model").string(), "--server", url,
                     "--served-model", model_name, "--api-key", api_key, "--samples", std::to_string(o.eval_samples), "--temperature",
                     "1.0", "--max-new-tokens", std::to_string(max_new), "--limit", std::to_string(o.eval_problems), "--seed", "7",
                     "--system-prompt", system_prompt, "--out", (run / ("eval-" + tag + ".json")).string()},
                    logs);
  };

  // 3. Held-out accuracy of the base model.
  json eval_base;
  if (o.resume && fs::exists(run / "eval-base.json")) {
    eval_base = json::parse(read_file(run / "eval-base.json"));
  } else {
    say("[3/6] held-out accuracy of the base model (sampled at temperature 1.0, graded by the verifier)");
    eval_base = eval("demo-base", "base");
  }
  say(fmt::format("      base accuracy {:.3f} on {} problems x {} samples", eval_base.value("accuracy", 0.0), o.eval_problems, o.eval_samples));

  // 4. Async GRPO with LoRA through the proxy and the bucket.
  const std::int64_t G = 8;
  const std::string cfg_path = (run / "train.toml").string();
  if (!o.resume || !fs::exists(cfg_path)) {
    demo::DemoTrainSettings ts;
    ts.output_dir = run.string();
    ts.seed = o.seed;
    ts.max_steps = o.steps;
    ts.model_path = (base / "model").string();
    ts.device = o.device;
    ts.train_file = (base / "train.jsonl").string();
    ts.system_prompt = system_prompt;
    ts.server_url = url;
    ts.max_new_tokens = max_new;
    ts.num_generations = G;
    ts.lr = o.lr;
    ts.max_staleness = o.max_staleness;
    ts.sync_transport = o.sync_transport;
    write_file_atomic(cfg_path, demo::demo_train_toml(ts));
  }
  say(std::string("[4/6] ") + (o.resume ? "resuming" : "running") + " async GRPO: " + std::to_string(o.steps) +
      " steps, G = 8, 32 samples per step, LoRA rank 8, sync every 2 steps, max_staleness 2 (log: " + (logs / "trainer.log").string() + ")");
  std::vector<std::string> targs = {exe, "train", "--config", cfg_path, "--set", "generation.server_url=\"" + url + "\"",
                                    "--api-key", api_key};
  if (o.resume && fs::exists(run / "checkpoints" / "latest")) targs.push_back("--resume");
  else if (o.resume) targs.push_back("--overwrite");
  if (o.resume && fs::exists(run / "final_adapter") && fs::exists(run / "eval-trained.json")) {
    say("      the run had finished; nothing to resume");
  } else {
    Child trainer("trainer", targs, logs);
    const fs::path mfile = run / "metrics.jsonl";
    std::int64_t shown = -1;
    const double t_train = now_s();
    for (;;) {
      if (g_signal) {
        say("\ninterrupted: stopping the trainer (it writes a checkpoint; `lorasync demo --resume` continues)");
        trainer.signal(SIGTERM);
        trainer.wait();
        return 130;
      }
      check_fleet();
      const bool alive = trainer.alive();
      auto ms = read_jsonl(mfile);
      if (!ms.empty() && static_cast<std::int64_t>(ms.size()) != shown) {
        shown = static_cast<std::int64_t>(ms.size());
        const json& m = ms.back();
        const std::int64_t step = m.value("step", std::int64_t{0});
        const double per = (now_s() - t_train) / std::max<double>(1.0, static_cast<double>(step - ms.front().value("step", std::int64_t{1}) + 1));
        const std::string line = fmt::format("  [{}] step {:>3}/{}  reward {:.3f}  ratio {:.5f}  staleness {:.2f}  v{}  {:.1f} s/step  ETA {:.0f} s",
                                             progress_bar(static_cast<double>(step) / static_cast<double>(o.steps), 24), step, o.steps,
                                             m.value("reward", 0.0), m.value("ratio", 1.0), m.value("sample/staleness_mean", 0.0),
                                             m.value("version", std::int64_t{0}), per, per * static_cast<double>(o.steps - step));
        if (tty) std::fprintf(stderr, "\r\033[K%s", line.c_str());
        else if (step % 5 == 0 || step == o.steps) std::fprintf(stderr, "%s\n", line.c_str());
        std::fflush(stderr);
      }
      if (!alive) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    if (tty) std::fprintf(stderr, "\n");
    if (trainer.code() != 0)
      throw Error(ErrorKind::kUnavailable, "the trainer stopped with " + trainer.status_text() + "; see " + trainer.log().string());
  }

  // 5. Held-out accuracy of the final adapter (loaded through the proxy on both replicas).
  say("[5/6] held-out accuracy of the trained adapter");
  {
    json body = {{"lora_name", "demo-final"}, {"lora_path", (run / "final_adapter").string()}};
    std::string out;
    http_call(proxy_port, "POST", "/v1/unload_lora_adapter", json{{"lora_name", "demo-final"}}.dump(), api_key, &out);
    const int st = http_call(proxy_port, "POST", "/v1/load_lora_adapter", body.dump(), api_key, &out);
    if (st != 200) throw Error(ErrorKind::kUnavailable, "loading the final adapter through the proxy failed: HTTP " + std::to_string(st) + " " + out);
  }
  json eval_trained = eval("demo-final", "trained");

  // 6. Summary, report.
  check_fleet();
  auto ms = read_jsonl(run / "metrics.jsonl");
  const std::size_t n = ms.size();
  const double r_first = mean_of(ms, "reward", 0, std::min<std::size_t>(10, n));
  const double r_last = mean_of(ms, "reward", n >= 10 ? n - 10 : 0, n);
  double stale_max = 0, tok_s = 0, ratio_min = 1e9, ratio_max = -1e9, mismatch_max = 0;
  int syncs = 0;
  std::vector<double> sync_times;
  for (const auto& m : ms) {
    stale_max = std::max(stale_max, m.value("sample/staleness_max", 0.0));
    if (m.contains("perf/weight_sync_s")) sync_times.push_back(m["perf/weight_sync_s"].get<double>()), ++syncs;
    ratio_min = std::min(ratio_min, m.value("ratio", 1.0));
    ratio_max = std::max(ratio_max, m.value("ratio", 1.0));
    mismatch_max = std::max(mismatch_max, m.value("mismatch/kl", 0.0));
  }
  std::sort(sync_times.begin(), sync_times.end());
  tok_s = mean_of(ms, "rollout/generated_tok_s", 0, n);
  const json last = n ? ms.back() : json::object();
  // Routing counters and adapter loads per replica.
  const std::string pstats = get_text(proxy_port, "/proxy/stats", api_key);
  json proxy_stats = json::parse(pstats, nullptr, false);
  std::vector<double> loads;
  for (auto p : ports) loads.push_back(prom_value(get_text(p, "/metrics", upstream_token), "lorasync_server_adapter_loads_total"));
  const std::int64_t versions = last.value("version", std::int64_t{0});
  std::string routing = "n/a";
  if (proxy_stats.is_object() && proxy_stats.contains("router")) {
    const auto& rt = proxy_stats["router"];
    routing = fmt::format("{} / {} / {} / {}", rt.value("routed", 0LL), rt.value("affinity", 0LL), rt.value("unmatched", 0LL),
                          rt.value("spilled", 0LL));
    write_file_atomic(run / "proxy_stats.json", proxy_stats.dump(1));
  }
  const double acc_base = eval_base.value("accuracy", 0.0), acc_trained = eval_trained.value("accuracy", 0.0);
  const auto failed = last.value("rollout/failed_total", std::int64_t{0});
  json summary = {
      {"rows",
       {{{"name", "steps"}, {"value", n}},
        {{"name", "reward, mean of first 10 steps"}, {"value", r_first}},
        {{"name", "reward, mean of last 10 steps"}, {"value", r_last}},
        {{"name", "held-out accuracy, base model"}, {"value", acc_base}},
        {{"name", "held-out accuracy, trained adapter"}, {"value", acc_trained}},
        {{"name", "accuracy gain"}, {"value", acc_trained - acc_base}},
        {{"name", "ratio (step mean), min / max"}, {"value", fmt::format("{:.4f} / {:.4f}", ratio_min, ratio_max)}},
        {{"name", "engine mismatch KL (max over steps)"}, {"value", fmt::format("{:.2e}", mismatch_max)}},
        {{"name", "staleness mean / max (syncs)"}, {"value", fmt::format("{:.2f} / {:.0f}", mean_of(ms, "sample/staleness_mean", 0, n), stale_max)}},
        {{"name", "weight syncs, p50 time (s)"}, {"value", fmt::format("{} , {:.3f}", syncs, sync_times.empty() ? 0.0 : sync_times[sync_times.size() / 2])}},
        {{"name", "adapter versions published"}, {"value", versions}},
        {{"name", "adapter loads per replica"}, {"value", fmt::format("{:.0f} / {:.0f}", loads[0], loads[1])}},
        {{"name", "generated tokens/s (mean)"}, {"value", tok_s}},
        {{"name", "failed rollout requests"}, {"value", failed}},
        {{"name", "retried rollout requests"}, {"value", last.value("rollout/retry_total", std::int64_t{0})}},
        {{"name", "proxy routing (routed / affinity / unmatched / spilled)"}, {"value", routing}},
        {{"name", "wall time (s)"}, {"value", now_s() - t_start}}}}};
  write_file_atomic(run / "summary.json", summary.dump(1));
  write_file_atomic(run / "eval.json", json{{"base", eval_base}, {"trained", eval_trained}}.dump(1));
  auto rep = report::write_report(run);
  say("[6/6] summary");
  for (const auto& row : summary["rows"]) {
    const auto& v = row["value"];
    std::string s = v.is_number_float() ? fmt::format("{:.3f}", v.get<double>()) : v.is_string() ? v.get<std::string>() : v.dump();
    std::fprintf(stderr, "  %-40s %s\n", row["name"].get<std::string>().c_str(), s.c_str());
  }
  say("  report: " + rep.html.string() + " (plots in " + (run / "plots").string() + ")");
  // Stop the fleet.
  for (auto it = fleet.rbegin(); it != fleet.rend(); ++it) (*it)->stop(10);
  // Quality bar of the demo (spec demo.md): a run that did not learn fails, with its numbers.
  demo::DemoOutcome outcome;
  outcome.accuracy_base = acc_base;
  outcome.accuracy_trained = acc_trained;
  outcome.reward_first10 = r_first;
  outcome.reward_last10 = r_last;
  outcome.failed_requests = failed;
  outcome.steps = static_cast<std::int64_t>(n);
  outcome.adapter_loads_replica0 = loads[0];
  outcome.adapter_loads_replica1 = loads[1];
  const auto failures = demo::quality_failures(outcome, o.bar);
  const bool ok = failures.empty();
  std::printf("%s\n", json{{"event", "demo_finished"}, {"ok", ok}, {"failures", failures}, {"accuracy_base", acc_base},
                           {"accuracy_trained", acc_trained}, {"reward_first10", r_first}, {"reward_last10", r_last},
                           {"min_accuracy_gain", o.bar.min_accuracy_gain}, {"min_reward_gain", o.bar.min_reward_gain},
                           {"report", rep.html.string()}, {"wall_s", now_s() - t_start}}.dump().c_str());
  std::fflush(stdout);
  if (!ok) {
    say("\nlorasync demo: the run did not learn: it missed the demo's quality bar:");
    for (const auto& f : failures) say("  - " + f);
    return demo::kDemoDidNotLearn;
  }
  say(fmt::format("  quality bar met: accuracy {:+.3f} (bar +{:.2f}), reward {:+.3f} (bar +{:.2f})", acc_trained - acc_base,
                  o.bar.min_accuracy_gain, r_last - r_first, o.bar.min_reward_gain));
  return 0;
}

}  // namespace

void register_demo(CLI::App& root, Registry& reg) {
  auto o = std::make_shared<DemoOptions>();
  auto* sub = root.add_subcommand("demo", "the whole system on one machine with a tiny model: watch async GRPO learn");
  sub->add_option("--run-dir", o->run_dir, "run folder (logs, bucket, checkpoints, metrics, report)")->capture_default_str();
  sub->add_option("--cache-dir", o->cache_dir, "where the demo base model is cached (default ~/.cache/lorasync)");
  sub->add_flag("--resume", o->resume, "continue an interrupted run from its last checkpoint");
  sub->add_option("--steps", o->steps, "GRPO steps")->capture_default_str();
  sub->add_option("--eval-problems", o->eval_problems, "held-out problems evaluated")->capture_default_str();
  sub->add_option("--eval-samples", o->eval_samples, "samples per held-out problem")->capture_default_str();
  sub->add_option("--seed", o->seed, "seed of the base model and the run")->capture_default_str();
  sub->add_option("--lr", o->lr, "learning rate of the LoRA adapter")->capture_default_str();
  sub->add_option("--device", o->device, "device of the replicas and the trainer: cpu|cuda[:N] (fp32)")
      ->capture_default_str();
  sub->add_option("--max-staleness", o->max_staleness, "async.max_staleness of the run (weight syncs)")->capture_default_str();
  sub->add_option("--sync-transport", o->sync_transport, "weight sync: auto | push | path (sync.transport)")
      ->check(CLI::IsMember({"auto", "push", "path"}))->capture_default_str();
  sub->add_option("--min-accuracy-gain", o->bar.min_accuracy_gain,
                  "quality bar: held-out accuracy of the trained adapter minus the base model's (exit 3 when below)")
      ->capture_default_str();
  sub->add_option("--min-reward-gain", o->bar.min_reward_gain,
                  "quality bar: mean reward of the last 10 steps minus the first 10 (exit 3 when below)")
      ->capture_default_str();
  sub->add_option("--model-steps", o->model_steps, "SFT steps of the base model (0 = default; tests use fewer)")
      ->capture_default_str();
  sub->add_option("--arch", o->arch, "the tiny base model's family: qwen2 | qwen3 | llama3 (docs/models.md)")
      ->check(CLI::IsMember({"qwen2", "qwen3", "llama3"}))
      ->capture_default_str();
  reg.add(sub, [o]() {
    try {
      return run_demo(*o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "\nlorasync demo: %s\n", e.what());
      return g_signal ? 130 : 1;
    }
  });
}

}  // namespace lorasync::cli
