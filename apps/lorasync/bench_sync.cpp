// `lorasync bench sync`: how long a weight sync takes to make a new adapter version live on every
// replica, by path and by push, with and without a bucket visibility lag (benchmarks.md).
//
// Two `lorasync serve` replicas (in-process, the --preset model shape with random bf16 weights)
// behind an in-process `lorasync proxy`, all on loopback. Each round publishes a fresh rank-r
// all-linear adapter version into the trainer's bucket directory exactly as the trainer does
// (save: files + manifest, fsynced; publish: rename + fsync), then makes it live:
//   path: POST /v1/load_lora_adapter through the proxy; the replicas read the version from their
//         view of the bucket and the proxy retries "No adapter found" until it shows up;
//   push: POST /v1/lorasync/adapters/push through the proxy with the version's bytes (prepare on
//         both, then commit on both).
// The lag is emulated unless --bucket-view names a real mount: the replicas read a second
// directory into which each version is copied (temp + rename) `lag` seconds after its publish.
// Reported per (transport, lag): end-to-end p50/p99 (save + publish + load/push), and the split
// save / publish / transfer (the proxy's prepare phase, or the whole load) / commit. Baseline of
// a push figure: the path figure at the same lag, same run.
#include <nlohmann/json.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "commands.h"
#include "core/io/adapter_manifest.h"
#include "core/io/checkpoint_dir.h"
#include "core/model/lora.h"
#include "core/model/decoder_model.h"
#include "http/blocking_client.h"
#include "model_options.h"
#include "proxy/proxy.h"
#include "rl/publisher.h"
#include "server/api_server.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/strings.h"

namespace lorasync::cli {

namespace {

using nlohmann::json;

struct BenchSyncOptions {
  std::string preset = "qwen2.5-1.5b-shape";
  std::int64_t rank = 1;
  int repeats = 20;
  std::string lags = "0,2";          // emulated bucket lags, s
  std::string transports = "path,push";  // path first: the baseline of the push figures
  std::string bucket;                // the trainer's bucket directory ("" = a temp dir)
  std::string bucket_view;           // the replicas' view of it (a real mount: no emulated lag)
  double retry_interval = 0.5;       // the proxy's "No adapter found" retry interval, s
};

// Copies each published version into the replicas' view `lag` seconds later (temp + rename).
class LaggingMirror {
 public:
  LaggingMirror(fs::path from, fs::path to, double lag) : from_(std::move(from)), to_(std::move(to)), lag_(lag) {
    fs::create_directories(to_);
    thread_ = std::thread([this] { loop(); });
  }
  ~LaggingMirror() {
    {
      std::lock_guard lk(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void published(const std::string& name) {
    {
      std::lock_guard lk(mu_);
      queue_.push_back({name, now_seconds() + lag_});
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    std::unique_lock lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return quit_ || !queue_.empty(); });
      if (quit_) return;
      auto [name, due] = queue_.front();
      if (now_seconds() < due) {
        cv_.wait_for(lk, std::chrono::duration<double>(due - now_seconds()));
        continue;
      }
      queue_.pop_front();
      lk.unlock();
      const fs::path tmp = to_ / (".copy-" + name);
      fs::copy(from_ / name, tmp, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
      fs::rename(tmp, to_ / name);
      lk.lock();
    }
  }
  fs::path from_, to_;
  double lag_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::string, double>> queue_;
  bool quit_ = false;
  std::thread thread_;
};

fs::path make_model(const fs::path& dir, const std::string& preset) {
  auto cfg = model::ModelConfig::preset(preset);
  auto tok = default_tokenizer_dir();
  if (tok.empty()) throw_invalid("bench sync needs the Qwen2 tokenizer (../shared/data/qwen2-tokenizer)");
  // bf16 on disk and in the replicas: only the adapter's shapes matter here, not compute speed.
  auto w = model::random_weights(cfg, 0, at::kBFloat16, 0.02);
  std::vector<io::TensorToWrite> ts;
  for (auto& [n, t] : w)
    ts.push_back({n, io::DType::kBF16, t.sizes().vec(),
                  {static_cast<const std::uint8_t*>(t.data_ptr()), static_cast<std::size_t>(t.nbytes())}});
  const fs::path m = dir / "model";
  fs::create_directories(m);
  io::write_weights(m, ts, 4ull << 30);
  write_file_atomic(m / "config.json", cfg.to_json());
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) write_file_atomic(m / f, read_file(fs::path(tok) / f));
  return m;
}

struct Round {
  double total_ms, save_ms, publish_ms, transfer_ms, commit_ms;
};

int run(const BenchSyncOptions& o) {
  TempDir tmp("lorasync-bench-sync");
  LS_LOG_INFO("bench", "bench sync: writing a random {} model (bf16)", o.preset);
  const fs::path model_dir = make_model(tmp.path(), o.preset);
  const fs::path bucket = o.bucket.empty() ? tmp.path() / "bucket" : fs::path(o.bucket);
  const fs::path adapters = bucket / "adapters";
  const bool real_view = !o.bucket_view.empty();

  std::vector<std::unique_ptr<server::ApiServer>> reps;
  std::vector<std::string> urls;
  for (int i = 0; i < 2; ++i) {
    server::ServeOptions so;
    so.model_dir = model_dir.string();
    so.served_model_name = "base";
    so.port = 0;
    so.dtype = "bfloat16";
    so.kv_cache_memory = "64MiB";
    so.max_model_len = 512;
    so.max_loras = 4;
    so.max_lora_rank = std::max<std::int64_t>(o.rank, 1);
    so.threads = 1;
    reps.push_back(std::make_unique<server::ApiServer>(so));
    reps.back()->start();
    urls.push_back("http://127.0.0.1:" + std::to_string(reps.back()->port()));
  }
  proxy::ProxyConfig pc;
  pc.listen = "127.0.0.1:0";
  pc.upstreams = urls;
  pc.upstream_token_env = "";
  pc.adapter_retry_interval = o.retry_interval;
  pc.reconcile_interval = 0;
  pc.stats_log_interval = 0;
  proxy::resolve_config(pc);
  proxy::Proxy px(pc);
  px.start();
  http::BlockingClient client("http://127.0.0.1:" + std::to_string(px.port()));

  auto cfg = model::ModelConfig::preset(o.preset);
  rl::AdapterPublisher pub(adapters, "policy", "base", "");
  model::LoraConfig lc;
  lc.rank = o.rank;
  lc.alpha = 2.0 * static_cast<double>(o.rank);
  lc.targets = model::LoraConfig::parse_targets({"all-linear"});
  auto adapter = model::LoraAdapter::init(lc, cfg, 7, at::kCPU);
  std::int64_t weight_bytes = 0;
  for (std::int64_t l = 0; l < adapter.n_layers(); ++l)
    for (auto m : lc.targets) weight_bytes += (adapter.A(l, m).numel() + adapter.B(l, m).numel()) * 4;
  std::int64_t version = 0;
  BenchReporter rep;
  std::map<std::pair<std::string, double>, double> p50_of;
  const auto transports = split(o.transports, ',');
  for (double lag : [&] {
         std::vector<double> v;
         for (const auto& s : split(o.lags, ',')) v.push_back(std::stod(s));
         return v;
       }()) {
    if (real_view && lag > 0) continue;  // a real mount lags by itself; reported as lag 0
    const fs::path view = real_view ? fs::path(o.bucket_view) / "adapters" : (lag > 0 ? tmp.path() / "view" / "adapters" : adapters);
    std::unique_ptr<LaggingMirror> mirror;
    if (!real_view && lag > 0) mirror = std::make_unique<LaggingMirror>(adapters, view, lag);
    for (const auto& tr : transports) {
      if (tr != "push" && tr != "path") throw_invalid("--transports takes push and path, got {}", tr);
      std::vector<Round> rounds;
      for (int i = 0; i < o.repeats + 1; ++i) {  // the first round warms up
        ++version;
        auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(version));
        for (std::int64_t l = 0; l < adapter.n_layers(); ++l)
          for (auto m : lc.targets) adapter.B(l, m).normal_(0, 0.01, gen);
        const double t0 = now_seconds();
        rl::Published p = pub.publish(adapter, version, version, tr == "push");
        if (mirror) mirror->published(p.name);
        Round r{};
        r.save_ms = p.save_s * 1e3;
        r.publish_ms = p.publish_s * 1e3;
        const double t1 = now_seconds();
        http::Pool::Full res;
        if (tr == "push") {
          res = client.request("POST", std::string(io::kPushPath), rl::push_bundle(p, (view / p.name).string()), 600,
                               false, "application/octet-stream");
        } else {
          res = client.request("POST", "/v1/load_lora_adapter",
                               json{{"lora_name", p.name}, {"lora_path", (view / p.name).string()}}.dump(), 600);
        }
        if (res.status != 200) throw_env("bench sync: {} of {} failed ({}): {}", tr, p.name, res.status, res.status ? res.body : res.message);
        r.total_ms = (now_seconds() - t0) * 1e3;
        const double live_ms = (now_seconds() - t1) * 1e3;
        auto j = json::parse(res.body, nullptr, false);
        if (tr == "push" && j.is_object() && j.contains("phases_ms")) {
          r.commit_ms = j["phases_ms"]["commit"].get<double>();
          r.transfer_ms = live_ms - r.commit_ms;
        } else {
          r.transfer_ms = live_ms;
        }
        client.request("POST", "/v1/unload_lora_adapter", json{{"lora_name", p.name}}.dump(), 60);
        if (i > 0) rounds.push_back(r);
      }
      auto col = [&](double Round::*f) {
        std::vector<double> v;
        for (const auto& r : rounds) v.push_back(r.*f);
        return v;
      };
      const double p50 = percentile(col(&Round::total_ms), 50);
      p50_of[{tr, lag}] = p50;
      std::optional<double> base;
      if (tr == "push" && p50_of.count({"path", lag})) base = p50_of[{"path", lag}];
      json cj = {{"transport", tr}, {"lag_s", lag}, {"rank", o.rank}, {"preset", o.preset}, {"replicas", 2},
                 {"weight_bytes", weight_bytes}, {"repeats", o.repeats}, {"real_bucket_view", real_view}};
      rep.emit({"sync", "sync_p50_ms", p50, "ms", base, cj});
      rep.emit({"sync", "sync_p99_ms", percentile(col(&Round::total_ms), 99), "ms", std::nullopt, cj});
      rep.emit({"sync", "save_p50_ms", percentile(col(&Round::save_ms), 50), "ms", std::nullopt, cj});
      rep.emit({"sync", "publish_p50_ms", percentile(col(&Round::publish_ms), 50), "ms", std::nullopt, cj});
      rep.emit({"sync", "transfer_p50_ms", percentile(col(&Round::transfer_ms), 50), "ms", std::nullopt, cj});
      if (tr == "push") rep.emit({"sync", "commit_p50_ms", percentile(col(&Round::commit_ms), 50), "ms", std::nullopt, cj});
    }
  }
  rep.print_table();
  px.stop();
  for (auto& r : reps) r->stop(1);
  return 0;
}

}  // namespace

void register_bench_sync(CLI::App& bench, Registry& reg) {
  auto o = std::make_shared<BenchSyncOptions>();
  auto* sub = bench.add_subcommand("sync", "weight sync through the proxy to 2 replicas, by push and by path");
  sub->add_option("--preset", o->preset, "model shape of the replicas and the adapter")->capture_default_str();
  sub->add_option("--rank", o->rank, "adapter rank (all-linear)")->capture_default_str();
  sub->add_option("--repeats", o->repeats, "timed syncs per (transport, lag)")->capture_default_str();
  sub->add_option("--lags", o->lags, "emulated bucket visibility lags, s (comma list)")->capture_default_str();
  sub->add_option("--transports", o->transports, "push,path")->capture_default_str();
  sub->add_option("--bucket", o->bucket, "the trainer's bucket directory (default: a temp dir)");
  sub->add_option("--bucket-view", o->bucket_view, "the replicas' view of --bucket (a real lagging mount)");
  sub->add_option("--retry-interval", o->retry_interval, "the proxy's No-adapter-found retry interval, s")->capture_default_str();
  reg.add(sub, [o] { return run(*o); });
}

}  // namespace lorasync::cli
