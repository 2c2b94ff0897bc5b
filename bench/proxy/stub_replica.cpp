#include "bench/proxy/stub_replica.h"

#include <utility>

#include <sys/resource.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <chrono>
#include <nlohmann/json.hpp>

#include "bench/proxy/completion_body.h"
#include "core/io/adapter_manifest.h"
#include "proxy/prompt_scan.h"
#include "util/error.h"
#include "util/random.h"

namespace lorasync::bench {

namespace net = boost::asio;
using Clock = std::chrono::steady_clock;

namespace {
http::Task<void> nap(double s) {
  if (s <= 0) co_return;
  net::steady_timer t(co_await net::this_coro::executor);
  t.expires_after(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)));
  boost::system::error_code ec;
  co_await t.async_wait(net::redirect_error(net::use_awaitable, ec));
}
}  // namespace

double service_time_factor(std::uint64_t seed, int index, std::uint64_t draw, double spread) {
  if (spread <= 0) return 1.0;
  // Draw `draw` of a SplitMix64 stream per (seed, index): no shared generator, no lock.
  const std::uint64_t stream = seed * kSplitMixGamma ^ static_cast<std::uint64_t>(index) * 0xd1b54a32d192ed03ull;
  const double u = unit_interval(splitmix64(stream + draw * kSplitMixGamma));
  return 1.0 + spread * (2.0 * u - 1.0);
}

StubReplica::StubReplica(StubOptions o, net::io_context* io) : opts_(std::move(o)) {
  latency_s.store(opts_.latency_s);
  load_fail_status.store(opts_.load_fail_status);
  http::ServerOptions so;
  so.host = opts_.host;
  so.port = opts_.port;
  so.threads = io ? 1 : opts_.threads;
  so.io = io;
  server_ = std::make_unique<http::Server>(so, [this](http::Request& r, http::ResponseWriter& w) { return handle(r, w); });
}

StubReplica::~StubReplica() { stop(); }
void StubReplica::start() { server_->start(); }
void StubReplica::stop() {
  if (server_) server_->stop(0.5);
}
std::uint16_t StubReplica::port() const { return server_->port(); }
std::string StubReplica::url() const { return "http://127.0.0.1:" + std::to_string(port()); }

StubFleet::StubFleet(const StubOptions& o, int n, bool one_thread)
    : io_(one_thread ? std::make_unique<net::io_context>(1) : nullptr) {
  for (int i = 0; i < n; ++i) {
    StubOptions x = o;
    x.index = i;
    stubs_.push_back(std::make_unique<StubReplica>(std::move(x), io_.get()));
  }
}

StubFleet::~StubFleet() {
  stop();
  io_.reset();  // its pending handlers go before the replicas they refer to
}

void StubFleet::start() {
  if (started_) return;
  started_ = true;
  for (auto& s : stubs_) s->start();  // their accepts keep io_ busy once the thread runs
  if (io_) thread_ = std::thread([io = io_.get()] { io->run(); });
}

void StubFleet::stop() {
  if (stopped_) return;
  stopped_ = true;
  for (auto& s : stubs_) s->stop();  // while the thread still serves them
  if (io_) io_->stop();
  if (thread_.joinable()) thread_.join();
}

std::vector<std::string> StubFleet::urls() const {
  std::vector<std::string> u;
  for (const auto& s : stubs_) u.push_back(s->url());
  return u;
}

std::vector<StubCall> StubReplica::calls() const {
  std::lock_guard lk(mu_);
  return calls_;
}
std::vector<std::string> StubReplica::loaded() const {
  std::lock_guard lk(mu_);
  return loaded_;
}
std::vector<std::string> StubReplica::prepared() const {
  std::lock_guard lk(mu_);
  return prepared_;
}
void StubReplica::add_adapter(const std::string& name) {
  std::lock_guard lk(mu_);
  loaded_.push_back(name);
}

void StubReplica::forget_adapters() {
  std::lock_guard lk(mu_);
  loaded_.clear();
  prepared_.clear();
  cache_.clear();
}

http::Task<void> StubReplica::handle(http::Request& req, http::ResponseWriter& w) {
  if (opts_.nice != 0) {
    // Each server thread sets its own nice value at its first request (Linux: per thread), once
    // even when it serves several stubs (StubFleet: they share one StubOptions, so one value).
    thread_local int thread_niced = 0;  // 0 not tried, 1 set, -1 refused
    if (thread_niced == 0)
      thread_niced = ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), opts_.nice) == 0 ? 1 : -1;
    if (nice_applied_.load(std::memory_order_relaxed) != thread_niced) nice_applied_.store(thread_niced);
  }
  const auto t0 = Clock::now();
  const std::string path(req.path());
  {
    StubCall c;
    c.method = req.method;
    c.target = req.target;
    for (const auto& h : req.headers) {
      c.header_names.push_back(h.name);
      if (http::iequals(h.name, "authorization")) {
        ++c.headers_authorization;
        c.authorization = h.value;
      }
      if (http::iequals(h.name, "x-request-id")) c.request_id = h.value;
    }
    if (path != "/v1/completions" && path != "/v1/chat/completions") c.body = req.body;
    c.completions_answered = completions_answered_.load();
    std::lock_guard lk(mu_);
    if (calls_.size() < 100000) calls_.push_back(std::move(c));
  }
  auto json = [&](int status, nlohmann::json j) {
    http::Response r = http::json_response(status, j.dump());
    r.headers.add("X-Stub-Index", std::to_string(opts_.index));
    return r;
  };
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    proxy::PromptScan scan;
    if (auto e = proxy::scan_routed_request(req.body, opts_.block_size, scan)) {
      {
        http::Response resp_ = http::error_response(400, e->message, e->param);
        co_await w.send(std::move(resp_));
      }
      co_return;
    }
    if (strict_models.load() && scan.model != "m" && scan.model != "base") {
      bool known;
      {
        std::lock_guard lk(mu_);
        known = std::find(loaded_.begin(), loaded_.end(), scan.model) != loaded_.end();
      }
      if (!known) {
        http::Response resp_ = http::error_response(404, "The model `" + scan.model + "` does not exist.", "model");
        co_await w.send(std::move(resp_));
        co_return;
      }
    }
    // Prefix cache: leading blocks already present are cached.
    const std::uint64_t unit = scan.kind == proxy::PromptKind::kText ? 4 * opts_.block_size : opts_.block_size;
    std::uint64_t hit = 0;
    {
      std::lock_guard lk(mu_);
      bool run = true;
      for (const auto& b : scan.blocks) {
        auto key = std::make_pair(b.lo, b.hi);
        if (run && cache_.count(key)) hit += unit;
        else run = false;
        cache_.insert(key);
      }
    }
    // Tokens: ids count as tokens; text as bytes / 4.
    std::uint64_t prompt = scan.kind == proxy::PromptKind::kText ? scan.n_units / 4 : scan.n_units;
    std::uint64_t cached = scan.kind == proxy::PromptKind::kText ? hit / 4 : hit;
    prompt_tokens_ += prompt;
    cached_tokens_ += cached;
    completions_ += 1;
    open_completions_ += 1;
    struct Close {
      std::atomic<int>& n;
      ~Close() { --n; }
    } close{open_completions_};
    if (hang.load()) {
      while (!w.client_gone().fired() && hang.load()) co_await nap(0.005);
      if (w.client_gone().fired()) {
        ++client_gone_;
        co_return;
      }
    }
    double service = latency_s.load();
    if (opts_.latency_spread > 0)
      service *= service_time_factor(opts_.seed, opts_.index, draws_.fetch_add(1), opts_.latency_spread);
    service += opts_.prefill_s_per_1k * static_cast<double>(prompt - cached) / 1000.0;
    const bool stream = req.body.find("\"stream\":true") != std::string::npos || req.body.find("\"stream\": true") != std::string::npos;
    nlohmann::json usage = {{"prompt_tokens", prompt}, {"completion_tokens", 1}, {"total_tokens", prompt + 1},
                            {"cached_prompt_tokens", cached}};
    if (!stream) {
      co_await nap(service);
      // The body `lorasync serve` answers to this request (completion_body.h): n choices of
      // max_tokens tokens, with logprobs and token ids when asked, as the trainer asks.
      CompletionAsk ask = read_completion_ask(req.body);
      ask.model = scan.model;
      CompletionMeta meta;
      meta.id = "cmpl-stub" + std::to_string(opts_.index) + "-" + std::to_string(completions_.load());
      meta.created = 1767225600;
      if (scan.model != "m" && scan.model != "base") meta.adapter = scan.model;
      meta.adapter_sha256 = std::string(64, 'a');
      meta.base_model_sha256 = std::string(64, 'b');
      meta.prompt_tokens = prompt;
      meta.cached_prompt_tokens = cached;
      http::Response r = http::json_response(200, completion_body(ask, meta, opts_.seed ^ completions_.load()));
      r.headers.add("X-Stub-Index", std::to_string(opts_.index));
      body_bytes_ += r.body.size();
      choices_ += static_cast<std::uint64_t>(std::max(1, ask.n));
      r.headers.add("X-Stub-Service-Us", std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count()));
      completions_answered_ += 1;
      co_await w.send(std::move(r));
      co_return;
    }
    co_await nap(service);
    http::Headers h;
    h.add("Content-Type", "text/event-stream");
    h.add("X-Stub-Index", std::to_string(opts_.index));
    if (!co_await w.start(200, h, std::nullopt)) co_return;
    for (int i = 0; i < opts_.sse_events; ++i) {
      nlohmann::json ev = {{"id", "cmpl-stub"}, {"choices", {{{"index", 0}, {"text", std::to_string(i)}}}}};
      if (i + 1 == opts_.sse_events) ev["usage"] = usage;
      if (!co_await w.write("data: " + ev.dump() + "\n\n")) {
        ++client_gone_;
        co_return;
      }
      co_await nap(opts_.sse_interval_s);
      if (w.client_gone().fired()) {
        ++client_gone_;
        w.abort();
        co_return;
      }
    }
    completions_answered_ += 1;
    co_await w.write("data: [DONE]\n\n");
    co_await w.finish();
    co_return;
  }
  if (path == "/v1/load_lora_adapter") {
    nlohmann::json j = nlohmann::json::parse(req.body, nullptr, false);
    if (!j.is_object() || !j.contains("lora_name")) {
      {
        http::Response resp_ = http::error_response(400, "lora_name required", "lora_name");
        co_await w.send(std::move(resp_));
      }
      co_return;
    }
    std::string name = j["lora_name"].get<std::string>();
    std::string lpath = j.value("lora_path", std::string("/nowhere"));
    int fail = load_fail_status.load();
    if (const double d = load_delay_s.load(); d > 0) co_await nap(d);
    if (hold_loads.load()) {
      while (hold_loads.load() && !w.client_gone().fired()) co_await nap(0.005);
      if (w.client_gone().fired()) co_return;
    }
    std::unique_lock lk(mu_);
    if (load_tries_++ < opts_.no_adapter_found_first) {
      lk.unlock();
      {
        http::Response resp_ = http::error_response(404, "No adapter found for " + lpath, "lora_path");
        co_await w.send(std::move(resp_));
      }
      co_return;
    }
    if (fail != 0) {
      lk.unlock();
      {
        http::Response resp_ = http::error_response(fail, "stub refuses adapter " + name + " (rank too large)");
        co_await w.send(std::move(resp_));
      }
      co_return;
    }
    const bool created = std::find(loaded_.begin(), loaded_.end(), name) == loaded_.end();
    if (created) loaded_.push_back(name);
    lk.unlock();
    {
      http::Response resp_ = json(200, {{"status", "ok"}, {"lora_name", name}, {"created", created}});
      co_await w.send(std::move(resp_));
    }
    co_return;
  }
  if (path == io::kPreparePath || path == io::kPushPath) {
    // Only the framing is checked: the stub has no model to verify the weights against.
    std::string name, refused;
    try {
      name = io::parse_adapter_bundle(req.body, false).lora_name;
    } catch (const Error& e) {
      refused = e.what();
    }
    int fail = prepare_fail_status.load();
    if (!refused.empty() || fail != 0) {
      http::Response resp_ = refused.empty() ? http::error_response(fail, "stub refuses the push of " + name)
                                             : http::error_response(400, refused);
      co_await w.send(std::move(resp_));
      co_return;
    }
    std::unique_lock lk(mu_);
    const bool created = std::find(loaded_.begin(), loaded_.end(), name) == loaded_.end();
    if (created && path == io::kPushPath) loaded_.push_back(name);
    if (created && path == io::kPreparePath && std::find(prepared_.begin(), prepared_.end(), name) == prepared_.end())
      prepared_.push_back(name);
    lk.unlock();
    http::Response resp_ = json(200, {{"status", path == io::kPushPath ? "ok" : "prepared"}, {"lora_name", name}, {"created", created}});
    co_await w.send(std::move(resp_));
    co_return;
  }
  if (path == io::kCommitPath || path == io::kAbortPath) {
    nlohmann::json j = nlohmann::json::parse(req.body, nullptr, false);
    std::string name = j.is_object() ? j.value("lora_name", std::string()) : std::string();
    if (path == io::kCommitPath && commit_fault.load() == 1) {
      // A replica that died between prepare and commit: the answer starts and never completes.
      http::Headers hh;
      hh.add("Content-Type", "application/json");
      co_await w.start(200, hh, 1000);
      w.abort();
      co_return;
    }
    if (path == io::kCommitPath && commit_fault.load() == 2) {
      http::Response resp_ = http::error_response(500, "stub fails the commit of " + name);
      co_await w.send(std::move(resp_));
      co_return;
    }
    std::unique_lock lk(mu_);
    auto it = std::find(prepared_.begin(), prepared_.end(), name);
    const bool was_prepared = it != prepared_.end();
    if (was_prepared) prepared_.erase(it);
    const bool resident = std::find(loaded_.begin(), loaded_.end(), name) != loaded_.end();
    if (path == io::kCommitPath && was_prepared) loaded_.push_back(name);
    lk.unlock();
    http::Response resp_ = path == io::kAbortPath
                               ? json(200, {{"status", was_prepared ? "aborted" : "not_prepared"}, {"lora_name", name}})
                           : was_prepared || resident ? json(200, {{"status", "ok"}, {"lora_name", name}, {"created", was_prepared}})
                                                      : http::error_response(404, "adapter '" + name + "' is not prepared");
    co_await w.send(std::move(resp_));
    co_return;
  }
  if (path == "/v1/unload_lora_adapter") {
    nlohmann::json j = nlohmann::json::parse(req.body, nullptr, false);
    std::string name = j.is_object() ? j.value("lora_name", std::string()) : std::string();
    std::unique_lock lk(mu_);
    auto it = std::find(loaded_.begin(), loaded_.end(), name);
    if (it == loaded_.end()) {
      lk.unlock();
      {
        http::Response resp_ = http::error_response(404, "adapter " + name + " not found", "lora_name");
        co_await w.send(std::move(resp_));
      }
      co_return;
    }
    loaded_.erase(it);
    lk.unlock();
    {
      http::Response resp_ = json(200, {{"status", "unloaded"}});
      co_await w.send(std::move(resp_));
    }
    co_return;
  }
  if (path == "/v1/models") {
    nlohmann::json data = nlohmann::json::array();
    data.push_back({{"id", "base"}, {"object", "model"}});
    for (const auto& n : loaded()) data.push_back({{"id", n}, {"object", "model"}, {"parent", "base"}});
    {
      http::Response resp_ = json(200, {{"object", "list"}, {"data", data}});
      co_await w.send(std::move(resp_));
    }
    co_return;
  }
  if (path == "/health" || path == "/ping") {
    int s = health_status.load();
    {
      http::Response resp_ = s == 200 ? json(200, {{"status", "ok"}}) : http::error_response(s, "stub unhealthy");
      co_await w.send(std::move(resp_));
    }
    co_return;
  }
  if (path == "/pause" || path == "/resume" || path == "/reset_prefix_cache") {
    if (path == "/pause") paused_.store(true);
    if (path == "/resume") paused_.store(false);
    if (path == "/reset_prefix_cache") {
      std::lock_guard lk(mu_);
      cache_.clear();
    }
    {
      http::Response resp_ = json(200, {{"status", "ok"}});
      co_await w.send(std::move(resp_));
    }
    co_return;
  }
  if (path == "/server_info") {
    auto r = json(200, {{"stub", opts_.index}});
    r.headers.add("Set-Cookie", "a=1");
    r.headers.add("Set-Cookie", "b=2");
    r.headers.add("Proxy-Authenticate", "Basic");
    r.headers.add("Trailer", "X-Nothing");
    co_await w.send(std::move(r));
    co_return;
  }
  {
    http::Response resp_ = http::error_response(404, "stub: no route " + path);
    co_await w.send(std::move(resp_));
  }
}

}  // namespace lorasync::bench
