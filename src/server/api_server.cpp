// The HTTP routes of `lorasync serve` (see api_server.h). The one Asio translation unit of the
// server: it bridges engine output (engine thread) to request coroutines (io threads).
#include <utility>

#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "server/api_server.h"

#include <nlohmann/json.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "core/io/checkpoint_dir.h"
#include "core/model/cpu_kernels.h"
#include "core/model/decoder_model.h"
#include "core/model/runtime.h"
#include "core/tokenizer/tokenizer.h"
#include "core/io/adapter_manifest.h"
#include "engine/adapter_store.h"
#include "engine/engine.h"
#include "http/server.h"
#include "server/offload.h"
#include "server/openai.h"
#include "util/error.h"
#include "util/files.h"
#include "util/log.h"
#include "util/sha256.h"
#include "util/strings.h"
#include "util/json_limits.h"

namespace lorasync::server {

namespace net = boost::asio;
using nlohmann::json;
using http::Task;

namespace {

// Bodies up to this size are parsed and tokenized on the io thread; larger ones on the pool.
constexpr std::size_t kInlineParseBytes = 256 << 10;

// LORASYNC_FAULTS (tests and drills only): comma-separated `step_fail=FROM:COUNT` (steps FROM ..
// FROM+COUNT-1 throw) and `step_hang=STEP:SECONDS` (step STEP sleeps). A bad spec fails the start.
std::function<void(std::int64_t)> engine_faults(const std::string& spec) {
  struct Fault {
    bool hang;
    std::int64_t from, count;
    double seconds;
  };
  std::vector<Fault> faults;
  for (const auto& item : split(spec, ',')) {
    auto eq = item.find('=');
    auto colon = item.find(':');
    if (eq == std::string::npos || colon == std::string::npos || colon < eq)
      throw_invalid("LORASYNC_FAULTS: '{}' is not step_fail=FROM:COUNT or step_hang=STEP:SECONDS", item);
    const std::string kind = item.substr(0, eq);
    try {
      const auto a = std::stoll(item.substr(eq + 1, colon - eq - 1));
      const auto b = std::stod(item.substr(colon + 1));
      if (kind == "step_fail") faults.push_back({false, a, static_cast<std::int64_t>(b), 0});
      else if (kind == "step_hang") faults.push_back({true, a, 1, b});
      else throw_invalid("LORASYNC_FAULTS: unknown fault '{}' (step_fail, step_hang)", kind);
    } catch (const std::logic_error&) {
      throw_invalid("LORASYNC_FAULTS: '{}' does not hold numbers", item);
    }
  }
  LS_LOG_WARN("server", "fault injection on: LORASYNC_FAULTS={}", spec);
  return [faults](std::int64_t step) {
    for (const auto& f : faults) {
      if (step < f.from || step >= f.from + f.count) continue;
      if (f.hang) std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds));
      else throw std::runtime_error(fmt::format("injected fault at step {}", step));
    }
  };
}

struct MethodNotAllowed {
  std::string message;
};

int status_of(const Error& e) {
  switch (e.kind()) {
    case ErrorKind::kInvalidInput:
    case ErrorKind::kUnsupported: return 400;
    case ErrorKind::kNotFound: return 404;
    case ErrorKind::kConflict: return 409;
    case ErrorKind::kForbidden: return 403;
    case ErrorKind::kUnavailable: return 507;
    default: return 500;
  }
}

std::string query_param(std::string_view query, std::string_view key) {
  for (const auto& kv : split(query, '&')) {
    auto eq = kv.find('=');
    if (kv.substr(0, eq) == key) return eq == std::string::npos ? "" : kv.substr(eq + 1);
  }
  return "";
}

json parse_body(const std::string& body) {
  check_json_depth(body);  // before any DOM work: error paths serialise values
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    throw Error(ErrorKind::kInvalidInput, std::string("request body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw Error(ErrorKind::kInvalidInput, "request body must be a JSON object");
  return j;
}

std::string string_field(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string())
    throw Error(ErrorKind::kInvalidInput, fmt::format("{} must be a string", key), key);
  return it->get<std::string>();
}

}  // namespace

struct ApiServer::Impl {
  ServeOptions opt;
  std::shared_ptr<const model::DecoderModel> model;
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  tok::ChatFormat chat_format = tok::ChatFormat::kChatml;  // the tokenizer_config.json's chat_template
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<http::Server> http;
  std::unique_ptr<BlockingPool> blocking;
  std::string base_sha256;
  std::string served_name;
  std::string api_key_digest;
  std::atomic<std::uint64_t> next_id{0};
  std::atomic<bool> stopped{false};
  mutable std::mutex metrics_mu;
  std::map<std::pair<std::string, int>, std::int64_t> http_counts;

  // Only known routes become a label value; any other path (a scan, a typo, a 401) is "other",
  // so the series stay bounded and the label never holds client bytes.
  static const std::string& route_label(const std::string& path) {
    static const std::array<std::string, 19> kRoutes = {
        "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/server_info", "/metrics",
        "/tokenize", "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/pause", "/resume",
        "/is_paused", "/reset_prefix_cache", "/get_world_size", std::string(io::kPushPath), std::string(io::kPreparePath),
        std::string(io::kCommitPath), std::string(io::kAbortPath)};
    static const std::string kOther = "other";
    for (const auto& r : kRoutes)
      if (r == path) return r;
    return kOther;
  }

  void count(const std::string& route, int status) {
    const std::string& label = route_label(route);
    std::lock_guard<std::mutex> lk(metrics_mu);
    ++http_counts[{label, status}];
  }

  Task<void> handle(http::Request& req, http::ResponseWriter& w);
  Task<void> completions(http::Request& req, http::ResponseWriter& w, bool chat);
  http::Response models() const;
  http::Response server_info(bool vllm) const;
  std::string metrics() const;
  bool authorized(const http::Request& req) const;
};

bool ApiServer::Impl::authorized(const http::Request& req) const {
  if (api_key_digest.empty()) return true;
  const std::string* h = req.headers.find("authorization");
  std::string given = h && starts_with(*h, "Bearer ") ? h->substr(7) : std::string();
  // Compare digests without an early exit.
  const std::string d = sha256_hex(given);
  unsigned diff = 0;
  for (std::size_t i = 0; i < d.size(); ++i) diff |= static_cast<unsigned>(d[i] ^ api_key_digest[i]);
  return diff == 0;
}

http::Response ApiServer::Impl::models() const {
  json data = json::array();
  data.push_back({{"id", served_name}, {"object", "model"}, {"created", 0}, {"owned_by", "lorasync"},
                  {"max_model_len", engine->options().max_model_len}, {"root", opt.model_dir}, {"parent", nullptr}});
  for (const auto& a : engine->adapters())
    data.push_back({{"id", a.name}, {"object", "model"}, {"created", 0}, {"owned_by", "lorasync"},
                    {"max_model_len", engine->options().max_model_len}, {"root", a.path}, {"parent", served_name},
                    {"adapter_sha256", a.sha256}});
  return http::json_response(200, json{{"object", "list"}, {"data", data}}.dump());
}

http::Response ApiServer::Impl::server_info(bool vllm) const {
  json lora = {{"max_loras", opt.max_loras}, {"max_lora_rank", opt.max_lora_rank},
               {"target_modules", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}};
  json info = {{"model", served_name},
               {"dtype", model::dtype_name(model->dtype())},
               {"device", model->device().str()},
               {"max_model_len", engine->options().max_model_len},
               {"lora_config", opt.max_loras > 0 ? lora : json(nullptr)},
               {"parallel_config", {{"data_parallel_size", 1}, {"tensor_parallel_size", 1}}},
               {"kv_cache", {{"block_size", opt.block_size}, {"num_blocks", engine->kv_num_blocks()},
                             {"enable_prefix_caching", opt.enable_prefix_caching}}},
               {"base_model_sha256", base_sha256},
               {"adapter_push", opt.max_loras > 0 ? json(io::kBundleFormat) : json(nullptr)},
               {"version", LORASYNC_VERSION}};
  if (vllm) {
    json v = {{"model_config", {{"model", served_name}, {"dtype", info["dtype"]}, {"max_model_len", info["max_model_len"]}}},
              {"lora_config", info["lora_config"]},
              {"parallel_config", info["parallel_config"]},
              {"cache_config", info["kv_cache"]}};
    info["vllm_config"] = v;
  }
  return http::json_response(200, info.dump());
}

std::string ApiServer::Impl::metrics() const {
  auto s = engine->stats();
  std::string o;
  auto gauge = [&](const char* name, const char* help, double v) {
    o += fmt::format("# HELP lorasync_server_{0} {1}\n# TYPE lorasync_server_{0} gauge\nlorasync_server_{0} {2}\n", name, help, v);
  };
  auto counter = [&](const char* name, const char* help, double v) {
    o += fmt::format("# HELP lorasync_server_{0} {1}\n# TYPE lorasync_server_{0} counter\nlorasync_server_{0} {2}\n", name, help, v);
  };
  gauge("requests_running", "sequences in the running batch", static_cast<double>(s.running));
  gauge("requests_waiting", "sequences waiting for admission", static_cast<double>(s.waiting));
  gauge("kv_blocks_used", "KV blocks in use", static_cast<double>(s.kv_blocks_used));
  gauge("kv_blocks_free", "KV blocks free or evictable", static_cast<double>(s.kv_blocks_total - s.kv_blocks_used));
  gauge("kv_blocks_cached", "KV blocks registered in the prefix cache", static_cast<double>(s.kv_blocks_cached));
  gauge("adapters_resident", "LoRA adapters resident", static_cast<double>(engine->adapters().size()));
  gauge("adapters_prepared", "pushed adapters prepared in a slot, waiting for their commit", static_cast<double>(engine->staged_adapters()));
  counter("requests_total", "requests accepted", static_cast<double>(s.requests_total));
  counter("requests_finished_total", "requests finished", static_cast<double>(s.requests_finished));
  counter("requests_aborted_total", "requests aborted", static_cast<double>(s.requests_aborted));
  counter("prompt_tokens_total", "prompt tokens of accepted requests", static_cast<double>(s.prompt_tokens_total));
  counter("generation_tokens_total", "generated tokens", static_cast<double>(s.generated_tokens_total));
  counter("prefix_cache_hit_tokens_total", "prompt tokens served from the prefix cache", static_cast<double>(s.prefix_cache_hit_tokens));
  counter("fork_shared_tokens_total", "prompt tokens shared by the n > 1 forks of a request", static_cast<double>(s.fork_shared_tokens));
  counter("prefill_tokens_computed_total", "prompt tokens computed", static_cast<double>(s.prefill_tokens_computed));
  counter("decode_graph_steps_total", "all-decode steps run by the CUDA-graph decode path",
          static_cast<double>(s.decode_graph_steps));
  counter("decode_graph_captures_total", "decode graphs captured (per batch-size bucket and adapter set)",
          static_cast<double>(s.decode_graph_captures));
  counter("preemptions_total", "sequences preempted (recomputed later)", static_cast<double>(s.preemptions));
  counter("adapter_loads_total", "adapter loads", static_cast<double>(s.adapter_loads));
  counter("adapter_load_failures_total", "adapter loads refused", static_cast<double>(s.adapter_load_failures));
  counter("adapter_unloads_total", "adapter unloads", static_cast<double>(s.adapter_unloads));
  counter("engine_step_failures_total", "engine steps that failed (their requests answered 500)", static_cast<double>(s.step_failures));
  counter("engine_command_failures_total", "engine commands that failed", static_cast<double>(s.command_failures));
  counter("requests_rejected_queue_full_total", "requests answered 429 (--max-queued-seqs)", static_cast<double>(s.rejected_queue_full));
  gauge("engine_healthy", "1 when /health answers 200", engine->health().healthy ? 1.0 : 0.0);
  if (http) {
    gauge("http_open_connections", "client connections open", static_cast<double>(http->open_connections()));
    gauge("http_max_connections", "connection cap (--max-connections)", static_cast<double>(http->max_connections()));
    counter("http_connections_refused_total", "connections answered 503 at the cap", static_cast<double>(http->refused_connections()));
  }
  o += "# HELP lorasync_server_adapter_requests_total requests per model (base or adapter)\n"
       "# TYPE lorasync_server_adapter_requests_total counter\n";
  for (const auto& [m, n] : s.requests_by_model)
    o += fmt::format("lorasync_server_adapter_requests_total{{model=\"{}\"}} {}\n", m, n);
  auto hist = [&](const char* name, const char* help, const engine::Histogram& h) {
    o += fmt::format("# HELP lorasync_server_{0} {1}\n# TYPE lorasync_server_{0} histogram\n", name, help);
    std::int64_t cum = 0;
    for (std::size_t i = 0; i < h.bounds.size(); ++i) {
      cum += h.counts[i];
      o += fmt::format("lorasync_server_{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds[i], cum);
    }
    cum += h.counts.back();
    o += fmt::format("lorasync_server_{0}_bucket{{le=\"+Inf\"}} {1}\nlorasync_server_{0}_sum {2}\nlorasync_server_{0}_count {3}\n",
                     name, cum, h.sum, h.count);
  };
  hist("time_to_first_token_seconds", "time from submission to the first token", s.ttft_hist);
  hist("inter_token_latency_seconds", "time between tokens of a sequence", s.itl_hist);
  std::lock_guard<std::mutex> lk(metrics_mu);
  o += "# HELP lorasync_server_http_requests_total HTTP requests by route and status\n"
       "# TYPE lorasync_server_http_requests_total counter\n";
  for (const auto& [k, n] : http_counts)
    o += fmt::format("lorasync_server_http_requests_total{{route=\"{}\",code=\"{}\"}} {}\n", k.first, k.second, n);
  return o;
}

Task<void> ApiServer::Impl::completions(http::Request& req, http::ResponseWriter& w, bool chat) {
  const std::string route = chat ? "/v1/chat/completions" : "/v1/completions";
  ParsedCompletion pc;
  if (req.body.size() <= kInlineParseBytes) {
    pc = chat ? parse_chat(req.body, *tokenizer, chat_format) : parse_completion(req.body, *tokenizer);
  } else {
    // Tokenizing megabytes takes long enough to starve this io thread's other connections
    // (health probes included): parse on the blocking pool.
    const std::string* body = &req.body;
    const tok::Tokenizer* tk = tokenizer.get();
    const tok::ChatFormat cf = chat_format;
    std::function<ParsedCompletion()> job = [body, tk, chat, cf] {
      return chat ? parse_chat(*body, *tk, cf) : parse_completion(*body, *tk);
    };
    auto pending = start_offload<ParsedCompletion>(*blocking, co_await net::this_coro::executor, std::move(job));
    pc = co_await finish_offload(pending);
  }
  auto info = engine->find_adapter(pc.model);
  if (!info)
    throw Error(ErrorKind::kNotFound, fmt::format("The model `{}` does not exist.", pc.model), "model");
  if (pc.max_tokens_unset) {
    // Chat without max_tokens: the rest of the context (as vLLM does).
    std::size_t longest = 0;
    for (const auto& p : pc.prompts) longest = std::max(longest, p.size());
    pc.params.max_tokens = std::max<std::int64_t>(1, engine->options().max_model_len - static_cast<std::int64_t>(longest));
  }
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + http::random_request_id().substr(0, 24);
  Provenance prov;
  prov.base_model_sha256 = base_sha256;
  if (pc.model != served_name) {
    prov.adapter = info->name;
    prov.adapter_sha256 = info->sha256;
  }
  const auto created = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  CompletionState state(id, created, pc, prov, tokenizer.get());
  auto ex = co_await net::this_coro::executor;
  auto ch = std::make_shared<Channel>(ex);
  std::vector<std::string> sub_ids;
  // Admission: a full queue answers 429 with Retry-After (the proxy and OpenAI clients back off).
  bool busy = false;
  std::string busy_msg;
  try {
    engine->check_capacity(static_cast<std::int64_t>(pc.prompts.size()) * pc.params.n);
  } catch (const Error& e) {
    busy = true;
    busy_msg = e.what();
  }
  if (busy) {
    auto r = http::error_response(429, busy_msg);
    r.headers.add("Retry-After", "1");
    count(route, 429);
    co_await w.send(std::move(r));
    co_return;
  }
  // Validate every sub-request before submitting any, so a bad prompt fails the whole request.
  std::vector<engine::RequestSpec> specs;
  for (std::size_t i = 0; i < pc.prompts.size(); ++i) {
    engine::RequestSpec spec;
    spec.id = id + "-" + std::to_string(i);
    spec.model = pc.model;
    spec.prompt = pc.prompts[i];
    spec.params = pc.params;
    spec.sink = std::make_shared<ChannelSink>(ch, i);
    engine->validate(spec);
    specs.push_back(std::move(spec));
  }
  for (auto& s : specs) {
    sub_ids.push_back(s.id);
    engine->submit(std::move(s));
  }
  LS_LOG_DEBUG("server", "{} submitted: {} prompt(s) of {} tokens, n {}, max_tokens {}", id, pc.prompts.size(),
               pc.prompts[0].size(), pc.params.n, pc.params.max_tokens);
  auto sub = w.client_gone().subscribe([this, sub_ids, ch] {
    for (const auto& s : sub_ids) engine->abort(s);
    ch->wake();
  });
  bool client_ok = true;
  if (pc.stream) {
    http::Headers h;
    h.add("Content-Type", "text/event-stream");
    h.add("Cache-Control", "no-cache");
    client_ok = co_await w.start(200, h, std::nullopt);
  }
  while (!state.all_done()) {
    Output o;
    while (ch->pop(o)) {
      std::string events = state.add(o.prompt_index, o.deltas, o.usage, o.done);
      if (pc.stream && client_ok && !events.empty()) client_ok = co_await w.write(events);
    }
    if (state.all_done()) break;
    // After a client disconnect the aborts are on their way: keep draining until every
    // sub-request reports done, so nothing is left in the engine.
    co_await ch->waker.wait();
  }
  w.client_gone().unsubscribe(sub);
  LS_LOG_DEBUG("server", "{} finished", id);
  if (pc.stream) {
    if (client_ok) {
      if (!state.error().empty()) w.abort();
      else if (co_await w.write(state.stream_tail())) co_await w.finish();
    }
    count(route, 200);
    co_return;
  }
  if (!state.error().empty()) {
    // The engine failed (500: the proxy retries elsewhere) or the model vanished mid-request (404).
    const int status = state.error_internal() ? 500 : 404;
    count(route, status);
    if (state.error_internal()) co_await w.send(http::error_response(500, state.error(), "", "internal_server_error"));
    else co_await w.send(http::error_response(404, state.error(), "model"));
    co_return;
  }
  count(route, 200);
  co_await w.send(http::json_response(200, state.final_json()));
}

Task<void> ApiServer::Impl::handle(http::Request& req, http::ResponseWriter& w) {
  const std::string path(req.path());
  const std::string& m = req.method;
  std::optional<http::Response> failure;
  try {
    if (path != "/health" && path != "/metrics" && !authorized(req)) {
      auto r = http::error_response(401, "invalid or missing API key (Authorization: Bearer <key>)");
      r.headers.add("WWW-Authenticate", "Bearer");
      count(path, 401);
      co_await w.send(std::move(r));
      co_return;
    }
    auto need = [&](const char* method) {
      if (m != method) throw MethodNotAllowed{fmt::format("method {} is not allowed on {} (use {})", m, path, method)};
    };
    if (path == "/v1/completions" || path == "/v1/chat/completions") {
      need("POST");
      co_await completions(req, w, path == "/v1/chat/completions");
      co_return;
    }
    http::Response r;
    if (path == "/health") {
      // 503 while the engine is stopped, stuck in a step or failing every step (the proxy's
      // health checks take the replica out of service; it comes back when this answers 200).
      const auto h = engine->health();
      r = h.healthy ? http::Response{200, {}, ""} : http::error_response(503, h.reason);
    } else if (path == "/v1/models") {
      r = models();
    } else if (path == "/server_info") {
      r = server_info(query_param(req.query(), "config_format") == "json");
    } else if (path == "/metrics") {
      r.status = 200;
      r.headers.add("Content-Type", "text/plain; version=0.0.4");
      r.body = metrics();
    } else if (path == "/tokenize") {
      need("POST");
      auto j = parse_body(req.body);
      std::vector<std::int32_t> ids;
      if (j.contains("messages")) {
        ids = parse_chat(req.body, *tokenizer, chat_format).prompts.at(0);
      } else {
        tok::EncodeOptions eo;
        eo.parse_special = true;
        ids = tokenizer->encode(string_field(j, "prompt"), eo);
      }
      r = http::json_response(200, json{{"tokens", ids}, {"count", ids.size()},
                                        {"max_model_len", engine->options().max_model_len}}.dump());
    } else if (path == "/detokenize") {
      need("POST");
      auto j = parse_body(req.body);
      if (!j.contains("tokens") || !j["tokens"].is_array())
        throw Error(ErrorKind::kInvalidInput, "tokens must be a list of token ids", "tokens");
      std::vector<std::int32_t> ids;
      for (const auto& t : j["tokens"]) {
        if (!t.is_number_integer() || !tokenizer->is_valid_id(t.get<std::int32_t>()))
          throw Error(ErrorKind::kInvalidInput, fmt::format("tokens holds {}, not a valid token id",
                                                                    t.is_structured() ? std::string(t.type_name()) : t.dump()), "tokens");
        ids.push_back(t.get<std::int32_t>());
      }
      r = http::json_response(200, json{{"prompt", tokenizer->decode(ids)}}.dump(-1, ' ', false, json::error_handler_t::replace));
    } else if (path == "/v1/load_lora_adapter") {
      need("POST");
      auto j = parse_body(req.body);
      auto name = string_field(j, "lora_name");
      auto lpath = string_field(j, "lora_path");
      if (name.empty()) throw Error(ErrorKind::kInvalidInput, "lora_name must not be empty", "lora_name");
      // vLLM's `load_inplace` (TRL sends false): names are immutable here, so a true value can only
      // reload the same content (200); other content under a loaded name stays a 409.
      if (j.contains("load_inplace") && !j["load_inplace"].is_boolean() && !j["load_inplace"].is_null())
        throw Error(ErrorKind::kInvalidInput, "load_inplace must be a boolean", "load_inplace");
      std::function<engine::LoadOutcome()> job = [this, name, lpath] {
        engine::AdapterLoadPolicy policy;
        policy.allowed_roots = opt.allowed_adapter_roots;
        policy.max_rank = opt.max_lora_rank;
        policy.base_sha256 = base_sha256;
        auto a = engine::read_adapter(name, lpath, policy, model->config(), model->device());
        return engine->install_adapter(std::move(a)).get();
      };
      auto pending = start_offload<engine::LoadOutcome>(*blocking, co_await net::this_coro::executor, std::move(job));
      engine::LoadOutcome out = co_await finish_offload(pending);
      LS_LOG_INFO("server", "adapter {} {} from {} (sha256 {})", name, out.created ? "loaded" : "already loaded",
                  lpath, out.sha256.substr(0, 12));
      r = http::json_response(200, json{{"status", "ok"}, {"lora_name", name}, {"adapter_sha256", out.sha256},
                                        {"rank", out.rank}, {"resident", out.resident}, {"created", out.created}}.dump());
    } else if (path == io::kPushPath || path == io::kPreparePath) {
      // An adapter version in the body (docs/http-api.md, "Adapter push"): verified and placed in
      // a slot off the io threads; push makes it visible at once, prepare waits for a commit.
      need("POST");
      const bool prepare = path == io::kPreparePath;
      auto body = std::make_shared<std::string>(std::move(req.body));
      auto pushed_name = std::make_shared<std::string>();  // set by the job, read after it
      std::function<engine::LoadOutcome()> job = [this, body, pushed_name, prepare] {
        const io::AdapterBundle b = io::parse_adapter_bundle(*body);
        *pushed_name = b.lora_name;
        engine::AdapterLoadPolicy policy;
        policy.max_rank = opt.max_lora_rank;
        policy.base_sha256 = base_sha256;
        auto a = engine::adapter_from_bundle(b, policy, model->config(), model->device());
        return (prepare ? engine->stage_adapter(std::move(a), opt.adapter_prepare_ttl_s) : engine->install_adapter(std::move(a))).get();
      };
      auto pending = start_offload<engine::LoadOutcome>(*blocking, co_await net::this_coro::executor, std::move(job));
      engine::LoadOutcome out = co_await finish_offload(pending);
      const std::string& name = *pushed_name;
      LS_LOG_INFO("server", "adapter {} {} by push (sha256 {})", name,
                  prepare ? (out.created ? "prepared" : "already prepared or loaded") : (out.created ? "loaded" : "already loaded"),
                  out.sha256.substr(0, 12));
      r = http::json_response(200, json{{"status", prepare ? "prepared" : "ok"}, {"lora_name", name}, {"adapter_sha256", out.sha256},
                                        {"rank", out.rank}, {"resident", out.resident}, {"created", out.created}}.dump());
    } else if (path == io::kCommitPath || path == io::kAbortPath) {
      need("POST");
      auto j = parse_body(req.body);
      auto name = string_field(j, "lora_name");
      if (path == io::kCommitPath) {
        std::function<engine::LoadOutcome()> job = [this, name] { return engine->commit_adapter(name).get(); };
        auto pending = start_offload<engine::LoadOutcome>(*blocking, co_await net::this_coro::executor, std::move(job));
        engine::LoadOutcome out = co_await finish_offload(pending);
        LS_LOG_INFO("server", "adapter {} {}", name, out.created ? "committed" : "already loaded");
        r = http::json_response(200, json{{"status", "ok"}, {"lora_name", name}, {"adapter_sha256", out.sha256},
                                          {"rank", out.rank}, {"resident", out.resident}, {"created", out.created}}.dump());
      } else {
        std::function<std::string()> job = [this, name] { return engine->abort_staged(name).get(); };
        auto pending = start_offload<std::string>(*blocking, co_await net::this_coro::executor, std::move(job));
        std::string status = co_await finish_offload(pending);
        LS_LOG_INFO("server", "adapter {}: prepare {}", name, status);
        r = http::json_response(200, json{{"status", status}, {"lora_name", name}}.dump());
      }
    } else if (path == "/v1/unload_lora_adapter") {
      need("POST");
      auto j = parse_body(req.body);
      auto name = string_field(j, "lora_name");
      std::function<std::string()> job = [this, name] { return engine->unload_adapter(name).get(); };
      auto pending = start_offload<std::string>(*blocking, co_await net::this_coro::executor, std::move(job));
      std::string status = co_await finish_offload(pending);
      LS_LOG_INFO("server", "adapter {} {}", name, status);
      r = http::json_response(200, json{{"status", status}, {"lora_name", name}}.dump());
    } else if (path == "/pause") {
      need("POST");
      std::string mode = query_param(req.query(), "mode");
      if (mode.empty()) mode = "abort";
      if (mode == "keep") engine->pause(engine::PauseMode::kKeep);
      else if (mode == "abort") engine->pause(engine::PauseMode::kAbort);
      else if (mode == "wait") engine->pause(engine::PauseMode::kWait);
      else throw Error(ErrorKind::kInvalidInput, fmt::format("mode must be keep, abort or wait; got '{}'", mode), "mode");
      r = http::json_response(200, json{{"status", "paused"}, {"mode", mode}}.dump());
    } else if (path == "/resume") {
      need("POST");
      engine->resume();
      r = http::json_response(200, json{{"status", "resumed"}}.dump());
    } else if (path == "/get_world_size") {
      // vLLM's inference world size (tensor x pipeline parallel processes): one engine here.
      r = http::json_response(200, json{{"world_size", 1}}.dump());
    } else if (path == "/is_paused") {
      r = http::json_response(200, json{{"is_paused", engine->is_paused()}}.dump());
    } else if (path == "/reset_prefix_cache") {
      need("POST");
      std::function<std::int64_t()> job = [this] { return engine->reset_prefix_cache().get(); };
      auto pending = start_offload<std::int64_t>(*blocking, co_await net::this_coro::executor, std::move(job));
      auto n = co_await finish_offload(pending);
      r = http::json_response(200, json{{"status", "ok"}, {"blocks_dropped", n}}.dump());
    } else {
      r = http::error_response(404, fmt::format("no route for {} {}", m, path));
    }
    count(path, r.status);
    co_await w.send(std::move(r));
  } catch (const MethodNotAllowed& e) {
    failure = http::error_response(405, e.message);
  } catch (const Error& e) {
    // A proxy retries `No adapter found` bodies: the message keeps vLLM's wording.
    failure = http::error_response(status_of(e), e.what(), e.param());
  } catch (const std::exception& e) {
    LS_LOG_ERROR("server", "{} {}: {}", m, path, e.what());
    failure = http::error_response(500, std::string("internal error: ") + e.what());
  }
  // (co_await is not allowed inside a handler block.)
  if (failure) {
    count(path, failure->status);
    if (!w.started()) co_await w.send(std::move(*failure));
    else w.abort();
  }
}

ApiServer::ApiServer(ServeOptions o) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.opt = std::move(o);
  namespace fs = std::filesystem;
  if (I.opt.model_dir.empty()) throw_invalid("--model is required");
  if (I.opt.api_key.empty())
    if (const char* k = std::getenv("LORASYNC_API_KEY")) I.opt.api_key = k;
  if (!I.opt.api_key.empty()) I.api_key_digest = sha256_hex(I.opt.api_key);
  I.served_name = I.opt.served_model_name.empty()
                      ? fs::path(I.opt.model_dir).lexically_normal().filename().string()
                      : I.opt.served_model_name;
  if (I.served_name.empty()) I.served_name = fs::path(I.opt.model_dir).parent_path().filename().string();
  model::set_compute_threads(I.opt.threads);
  auto device = model::parse_device(I.opt.device);
  auto dtype = model::parse_dtype(I.opt.dtype, device, "--dtype");
  I.model = model::DecoderModel::load(I.opt.model_dir, dtype, device);
  const std::string tok_path = I.opt.tokenizer.empty() ? I.opt.model_dir : I.opt.tokenizer;
  I.tokenizer = std::make_shared<const tok::Tokenizer>(tok::Tokenizer::load(tok_path));
  // tokenizer_config.json sits beside tokenizer.json (a file path names that file).
  I.chat_format = tok::chat_format_of_dir(std::filesystem::is_directory(tok_path)
                                              ? tok_path
                                              : std::filesystem::path(tok_path).parent_path().string());
  I.base_sha256 = io::model_identity_sha256(I.opt.model_dir);
  engine::EngineOptions eo;
  eo.served_model_name = I.served_name;
  eo.max_model_len = I.opt.max_model_len > 0 ? I.opt.max_model_len : I.model->config().max_position_embeddings;
  eo.max_num_seqs = I.opt.max_num_seqs;
  eo.max_num_batched_tokens = I.opt.max_num_batched_tokens;
  eo.block_size = I.opt.block_size;
  eo.kv_cache_bytes = static_cast<std::int64_t>(parse_bytes(I.opt.kv_cache_memory, "--kv-cache-memory"));
  eo.enable_prefix_caching = I.opt.enable_prefix_caching;
  eo.graph_mode = I.opt.enforce_eager ? engine::EngineOptions::GraphMode::kOff : engine::EngineOptions::GraphMode::kAuto;
  eo.max_loras = I.opt.max_loras;
  eo.max_lora_rank = I.opt.max_lora_rank;
  for (auto id : I.model->config().eos_token_ids) eo.eos_ids.push_back(static_cast<std::int32_t>(id));
  if (auto e = I.tokenizer->special_tokens().eos)
    if (std::find(eo.eos_ids.begin(), eo.eos_ids.end(), *e) == eo.eos_ids.end()) eo.eos_ids.push_back(*e);
  if (I.opt.max_queued_seqs < 0) throw_invalid("--max-queued-seqs must be >= 0, got {}", I.opt.max_queued_seqs);
  if (!(I.opt.step_timeout_s > 0)) throw_invalid("--step-timeout must be positive, got {}", I.opt.step_timeout_s);
  eo.max_queued_seqs = I.opt.max_queued_seqs > 0 ? I.opt.max_queued_seqs : std::max<std::int64_t>(4096, 16 * I.opt.max_num_seqs);
  eo.step_timeout_s = I.opt.step_timeout_s;
  if (const char* f = std::getenv("LORASYNC_FAULTS"); f && *f) eo.before_forward = engine_faults(f);
  I.engine = std::make_unique<engine::Engine>(I.model, I.tokenizer, eo);
  I.blocking = std::make_unique<BlockingPool>(4);
  http::ServerOptions so;
  so.host = I.opt.host;
  so.port = I.opt.port;
  so.threads = std::max(1, I.opt.http_threads);
  so.max_body_bytes = I.opt.max_body_bytes;
  so.max_connections = I.opt.max_connections;
  if (!(I.opt.adapter_prepare_ttl_s > 0))
    throw_invalid("--adapter-prepare-ttl must be positive, got {}", I.opt.adapter_prepare_ttl_s);
  // A push carries a whole adapter version: the largest one of --max-lora-rank plus its header.
  const std::uint64_t push_limit = engine::max_adapter_weights_bytes(I.model->config(), I.opt.max_lora_rank) + (2ull << 20);
  so.route_body_limits = {{std::string(io::kPushPath), push_limit}, {std::string(io::kPreparePath), push_limit}};
  Impl* ip = &I;
  I.http = std::make_unique<http::Server>(so, [ip](http::Request& req, http::ResponseWriter& w) -> Task<void> {
    return ip->handle(req, w);
  });
}

ApiServer::~ApiServer() { stop(0); }

void ApiServer::start() {
  impl_->http->start();
  const bool cpu = impl_->model->device().is_cpu();
  LS_LOG_INFO("server", "serving {} on http://{}:{} ({} {}{}{})", impl_->served_name, impl_->opt.host,
              impl_->http->port(), model::dtype_name(impl_->model->dtype()), impl_->model->device().str(),
              cpu ? ", CPU kernels " : "", cpu ? model::cpu::kernels_name() : "");
}

std::uint16_t ApiServer::port() const { return impl_->http->port(); }

void ApiServer::stop(double grace_s) {
  if (impl_->stopped.exchange(true)) return;
  if (impl_->http) impl_->http->stop(grace_s);
  // Blocking jobs (adapter reads, waits on engine futures) finish before the engine goes: a load
  // still running after the grace period must not find the engine gone. Each is bounded (a load
  // reads regular files of capped size under a deadline), so the join is bounded too.
  impl_->blocking.reset();
  impl_->engine.reset();  // aborts what is left; wake-ups go to the stopped io_context
  impl_->http.reset();
}

void ApiServer::wait() {
  if (impl_->http) impl_->http->wait();
}

}  // namespace lorasync::server
