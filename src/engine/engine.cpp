#include "engine/engine.h"

#include <ATen/ATen.h>

#include <limits>

#include "core/model/device_kernels.h"
#include "core/model/runtime.h"
#include "engine/engine_impl.h"
#include "util/error.h"
#include "util/log.h"

namespace lorasync::engine {


Histogram Histogram::latency() {
  Histogram h;
  h.bounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
  h.counts.assign(h.bounds.size() + 1, 0);
  return h;
}

void Histogram::observe(double v) {
  std::size_t i = 0;
  while (i < bounds.size() && v > bounds[i]) ++i;
  ++counts[i];
  sum += v;
  ++count;
}


// ---- public API ----------------------------------------------------------------------------

Engine::Engine(std::shared_ptr<const model::DecoderModel> m, std::shared_ptr<const tok::Tokenizer> t,
               EngineOptions opts)
    : opts_(std::move(opts)) {
  const auto& cfg = m->config();
  if (opts_.block_size <= 0) throw_invalid("--block-size must be positive, got {}", opts_.block_size);
  if (opts_.max_model_len <= 1) throw_invalid("--max-model-len must be at least 2, got {}", opts_.max_model_len);
  if (opts_.max_model_len > cfg.max_position_embeddings)
    throw_invalid("--max-model-len {} exceeds the model's max_position_embeddings {}",
                  opts_.max_model_len, cfg.max_position_embeddings);
  if (opts_.max_num_seqs <= 0) throw_invalid("--max-num-seqs must be positive");
  if (opts_.max_num_batched_tokens <= 0) throw_invalid("--max-num-batched-tokens must be positive");
  if (opts_.max_loras < 0) throw_invalid("--max-loras must be >= 0");
  const std::int64_t per_block = model::KvPool::bytes_per_slot(cfg, m->dtype()) * opts_.block_size;
  const std::int64_t n_blocks = opts_.kv_cache_bytes / per_block;
  if (n_blocks * opts_.block_size < opts_.max_model_len)
    throw_invalid(
        "--kv-cache-memory {} bytes holds {} tokens ({} blocks of {}), fewer than --max-model-len {}; "
        "raise --kv-cache-memory to at least {} bytes or lower --max-model-len",
        opts_.kv_cache_bytes, n_blocks * opts_.block_size, n_blocks, opts_.block_size,
        opts_.max_model_len, (opts_.max_model_len + opts_.block_size - 1) / opts_.block_size * per_block);
  impl_ = std::make_unique<Impl>(std::move(m), std::move(t), opts_);
  using GraphMode = EngineOptions::GraphMode;
  const auto dev = impl_->model->device();
  const bool graphs = opts_.graph_mode == GraphMode::kAlways ||
                      (opts_.graph_mode == GraphMode::kAuto && dev.is_cuda() && model::have_cuda_kernels());
  // With decode graphs, one slot past the blocks' is the padding rows' scratch slot.
  impl_->pool = std::make_unique<model::KvPool>(model::KvPool::allocate(
      cfg, n_blocks * opts_.block_size + (graphs ? 1 : 0), impl_->model->dtype(), dev));
  if (graphs) {
    model::DecodeGraphs::Options go;
    // Contexts up to 8,192 tokens replay graphs (as vLLM's default); a step with a longer row
    // runs eagerly. The static context table costs 8 bytes per row and position.
    go.max_context = std::min<std::int64_t>(opts_.max_model_len, 8192);
    go.scratch_slot = n_blocks * opts_.block_size;
    // Each adapter slot gets a fixed copy the graphs read (a larger rank or more slots than the
    // batched LoRA kernel takes: those steps run eagerly).
    go.lora_slots = opts_.max_lora_rank > 0 ? std::min(opts_.max_loras, model::cuda::kLoraKernelMaxAdapters) : 0;
    go.lora_rank = go.lora_slots > 0 ? std::min<std::int64_t>(opts_.max_lora_rank, model::cuda::kLoraKernelMaxRank) : 0;
    std::erase_if(go.buckets, [&](std::int64_t b) { return b > opts_.max_num_seqs; });
    for (std::int64_t b = 384; b < opts_.max_num_seqs; b += 128) go.buckets.push_back(b);
    go.buckets.push_back(opts_.max_num_seqs);
    impl_->graphs = std::make_unique<model::DecodeGraphs>(*impl_->model, *impl_->pool, go);
    if (opts_.graph_mode == GraphMode::kAuto && !impl_->graphs->capturing()) impl_->graphs.reset();
  }
  impl_->bm = std::make_unique<BlockManager>(n_blocks, opts_.block_size, opts_.enable_prefix_caching);
  impl_->base_seed = seed_hash(std::string("base\0", 5) + opts_.served_model_name);
  impl_->slots.resize(static_cast<std::size_t>(opts_.max_loras));
  impl_->publish_stats();
  LS_LOG_INFO("engine", "KV cache: {} blocks of {} tokens ({:.1f} MiB), {} adapter slots",
              n_blocks, opts_.block_size, static_cast<double>(n_blocks * per_block) / (1 << 20),
              opts_.max_loras);
  impl_->alive = true;  // before the thread starts: /health must not see a starting engine as dead
  // The engine thread computes from now on: the workers this thread used to load and zero are
  // ended, or the engine's would sleep between regions (model::release_compute_threads).
  model::release_compute_threads();
  impl_->thread = std::thread([this] { impl_->loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_one();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::int64_t Engine::kv_num_blocks() const { return impl_->bm->n_blocks(); }

void Engine::validate(const RequestSpec& spec) const {
  const auto& p = spec.params;
  auto bad = [](const char* param, std::string msg) {
    throw Error(ErrorKind::kInvalidInput, std::move(msg), param);
  };
  if (p.max_tokens < 1) bad("max_tokens", fmt::format("max_tokens must be at least 1, got {}", p.max_tokens));
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature))
    bad("temperature", fmt::format("temperature must be a finite number >= 0, got {}", p.temperature));
  if (!(p.top_p > 0 && p.top_p <= 1)) bad("top_p", fmt::format("top_p must be in (0, 1], got {}", p.top_p));
  if (p.top_k < -1) bad("top_k", fmt::format("top_k must be -1, 0 (off) or positive, got {}", p.top_k));
  if (!(p.min_p >= 0 && p.min_p <= 1)) bad("min_p", fmt::format("min_p must be in [0, 1], got {}", p.min_p));
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty))
    bad("repetition_penalty", fmt::format("repetition_penalty must be > 0, got {}", p.repetition_penalty));
  if (p.n < 1 || p.n > opts_.max_n) bad("n", fmt::format("n must be in [1, {}], got {}", opts_.max_n, p.n));
  if (p.logprobs && (*p.logprobs < 0 || *p.logprobs > opts_.max_logprobs))
    bad("logprobs", fmt::format("logprobs must be in [0, {}], got {}", opts_.max_logprobs, *p.logprobs));
  if (spec.prompt.empty()) bad("prompt", "prompt must not be empty");
  const auto vocab = impl_->model->config().vocab_size;
  for (std::size_t i = 0; i < spec.prompt.size(); ++i)
    if (spec.prompt[i] < 0 || spec.prompt[i] >= vocab)
      bad("prompt", fmt::format("prompt token id {} at position {} is outside the vocabulary [0, {})",
                                spec.prompt[i], i, vocab));
  for (auto id : p.stop_token_ids)
    if (id < 0 || id >= vocab)
      bad("stop_token_ids", fmt::format("stop_token_ids holds {}, outside the vocabulary [0, {})", id, vocab));
  const auto P = static_cast<std::int64_t>(spec.prompt.size());
  if (P >= opts_.max_model_len)
    bad("prompt", fmt::format("This model's maximum context length is {} tokens, but the prompt has {} "
                              "tokens. Please reduce the length of the prompt.",
                              opts_.max_model_len, P));
  if (p.max_tokens > opts_.max_model_len - P)  // not P + max_tokens: max_tokens may be near INT64_MAX
    bad("max_tokens",
        fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens "
                    "({} in the prompt, {} for the completion). Please reduce the length of the "
                    "prompt or max_tokens.",
                    opts_.max_model_len,
                    p.max_tokens > std::numeric_limits<std::int64_t>::max() - P ? std::numeric_limits<std::int64_t>::max()
                                                                                 : P + p.max_tokens,
                    P, p.max_tokens));
  if (!find_adapter(spec.model))
    throw Error(ErrorKind::kNotFound, fmt::format("The model `{}` does not exist.", spec.model), "model");
}

void Engine::check_capacity(std::int64_t seqs) const {
  if (opts_.max_queued_seqs <= 0) return;
  const std::int64_t q = impl_->queued_seqs.load();
  if (q + seqs > opts_.max_queued_seqs) {
    impl_->rejected_queue_full.fetch_add(1);
    throw Error(ErrorKind::kUnavailable,
                fmt::format("the server is busy: {} sequences are queued or running and this request adds {} "
                            "(limit {}, --max-queued-seqs); retry later",
                            q, seqs, opts_.max_queued_seqs));
  }
}

void Engine::submit(RequestSpec spec) {
  validate(spec);
  impl_->queued_seqs += spec.params.n;
  auto shared = std::make_shared<RequestSpec>(std::move(spec));
  impl_->post([this, shared] { impl_->add_request(std::move(*shared)); });
}

void Engine::abort(const std::string& request_id) {
  impl_->post([this, request_id] {
    auto it = impl_->groups.find(request_id);
    if (it != impl_->groups.end()) impl_->abort_group(it->second.get(), FinishReason::kAbort);
  });
}

int Engine::Impl::find_staged(const std::string& name) const {
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (slots[i].staged && slots[i].adapter->name == name) return static_cast<int>(i);
  return -1;
}

int Engine::Impl::free_slot(double now) const {
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (!slots[i].adapter) return static_cast<int>(i);
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (slots[i].draining && slots[i].inflight == 0) return static_cast<int>(i);
  for (std::size_t i = 0; i < slots.size(); ++i)
    if (slots[i].staged && slots[i].staged_until < now) return static_cast<int>(i);
  return -1;
}

std::future<LoadOutcome> Engine::install_adapter(LoadedAdapter adapter) { return place_adapter(std::move(adapter), false, 0); }

std::future<LoadOutcome> Engine::stage_adapter(LoadedAdapter adapter, double ttl_s) {
  return place_adapter(std::move(adapter), true, ttl_s);
}

std::future<LoadOutcome> Engine::place_adapter(LoadedAdapter adapter, bool staged, double ttl_s) {
  auto prom = std::make_shared<std::promise<LoadOutcome>>();
  auto fut = prom->get_future();
  auto a = std::make_shared<LoadedAdapter>(std::move(adapter));
  impl_->post([this, prom, a, staged, ttl_s] {
    Impl& I = *impl_;
    try {
      if (a->name == opts_.served_model_name)
        throw Error(ErrorKind::kInvalidInput,
                    fmt::format("lora_name '{}' is the base model's name", a->name), "lora_name");
      const double now = now_seconds();
      auto same_or_conflict = [&](const LoadedAdapter& cur, const char* where) {
        if (cur.sha256 != a->sha256)
          throw Error(ErrorKind::kConflict,
                      fmt::format("adapter '{}' is already {} with other content (sha256 {} vs {}); "
                                  "adapter names are immutable",
                                  a->name, where, cur.sha256, a->sha256),
                      "lora_name");
      };
      int existing = I.find_slot(a->name, false);
      if (existing >= 0) {
        const auto& cur = *I.slots[static_cast<std::size_t>(existing)].adapter;
        same_or_conflict(cur, "loaded");
        prom->set_value(LoadOutcome{false, cur.weights->config().rank, static_cast<std::int64_t>(I.snap_adapters.size()), cur.sha256});
        return;
      }
      int slot = I.find_staged(a->name);
      if (slot >= 0) {
        // Prepared before: the same content is prepared again (a retried prepare refreshes the
        // deadline; a path load of it commits it), other content is refused.
        Slot& sl = I.slots[static_cast<std::size_t>(slot)];
        same_or_conflict(*sl.adapter, "prepared");
        if (staged) {
          sl.staged_until = now + ttl_s;
          prom->set_value(LoadOutcome{false, sl.adapter->weights->config().rank,
                                      static_cast<std::int64_t>(I.snap_adapters.size()), sl.adapter->sha256});
          return;
        }
      } else {
        slot = I.free_slot(now);
      }
      if (slot < 0)
        throw Error(ErrorKind::kUnavailable,
                    fmt::format("all {} adapter slots (--max-loras) hold adapters with requests in flight "
                                "or prepared ones; unload one first",
                                I.slots.size()),
                    "lora_name");
      Slot& sl = I.slots[static_cast<std::size_t>(slot)];
      sl.adapter = a;
      sl.inflight = 0;
      sl.draining = false;
      sl.staged = staged;
      sl.staged_until = staged ? now + ttl_s : 0;
      sl.seed = seed_hash(a->name + std::string("\0", 1) + a->sha256);
      sl.order = ++I.load_counter;
      if (!staged) ++I.st.adapter_loads;
      I.publish_adapters();
      prom->set_value(LoadOutcome{true, a->weights->config().rank,
                                  static_cast<std::int64_t>(I.snap_adapters.size()), a->sha256});
    } catch (...) {
      ++I.st.adapter_load_failures;
      prom->set_exception(std::current_exception());
    }
  });
  return fut;
}

std::future<LoadOutcome> Engine::commit_adapter(const std::string& name) {
  auto prom = std::make_shared<std::promise<LoadOutcome>>();
  auto fut = prom->get_future();
  impl_->post([this, prom, name] {
    Impl& I = *impl_;
    int cur = I.find_slot(name, false);
    if (cur >= 0) {
      const auto& a = *I.slots[static_cast<std::size_t>(cur)].adapter;
      prom->set_value(LoadOutcome{false, a.weights->config().rank, static_cast<std::int64_t>(I.snap_adapters.size()), a.sha256});
      return;
    }
    // A staged slot past its deadline still commits while nothing has reclaimed it.
    int s = I.find_staged(name);
    if (s < 0) {
      ++I.st.adapter_load_failures;
      prom->set_exception(std::make_exception_ptr(Error(
          ErrorKind::kNotFound,
          fmt::format("adapter '{}' is not prepared on this server (never prepared, aborted, or its slot was "
                      "reclaimed after the prepare deadline)",
                      name),
          "lora_name")));
      return;
    }
    Slot& sl = I.slots[static_cast<std::size_t>(s)];
    sl.staged = false;
    sl.staged_until = 0;
    sl.order = ++I.load_counter;
    ++I.st.adapter_loads;
    I.publish_adapters();
    prom->set_value(LoadOutcome{true, sl.adapter->weights->config().rank,
                                static_cast<std::int64_t>(I.snap_adapters.size()), sl.adapter->sha256});
  });
  return fut;
}

std::future<std::string> Engine::abort_staged(const std::string& name) {
  auto prom = std::make_shared<std::promise<std::string>>();
  auto fut = prom->get_future();
  impl_->post([this, prom, name] {
    Impl& I = *impl_;
    int s = I.find_staged(name);
    if (s < 0) {
      prom->set_value("not_prepared");
      return;
    }
    Slot& sl = I.slots[static_cast<std::size_t>(s)];
    sl.adapter.reset();
    sl.staged = false;
    sl.staged_until = 0;
    I.publish_adapters();
    prom->set_value("aborted");
  });
  return fut;
}

std::int64_t Engine::staged_adapters() const {
  std::lock_guard<std::mutex> lk(impl_->snap_mu);
  return impl_->snap_staged;
}

std::future<std::string> Engine::unload_adapter(const std::string& name) {
  auto prom = std::make_shared<std::promise<std::string>>();
  auto fut = prom->get_future();
  impl_->post([this, prom, name] {
    Impl& I = *impl_;
    int s = I.find_slot(name, false);
    if (s < 0) {
      prom->set_exception(std::make_exception_ptr(
          Error(ErrorKind::kNotFound, fmt::format("adapter '{}' is not loaded", name), "lora_name")));
      return;
    }
    Slot& sl = I.slots[static_cast<std::size_t>(s)];
    ++I.st.adapter_unloads;
    if (sl.inflight == 0) {
      sl.adapter.reset();
      sl.draining = false;
      I.publish_adapters();
      prom->set_value("unloaded");
    } else {
      sl.draining = true;
      I.publish_adapters();
      prom->set_value("draining");
    }
  });
  return fut;
}

std::optional<AdapterInfo> Engine::find_adapter(const std::string& name) const {
  if (name == opts_.served_model_name) return AdapterInfo{name, "", "", 0};
  std::lock_guard<std::mutex> lk(impl_->snap_mu);
  for (const auto& a : impl_->snap_adapters)
    if (a.name == name) return a;
  return std::nullopt;
}

std::vector<AdapterInfo> Engine::adapters() const {
  std::lock_guard<std::mutex> lk(impl_->snap_mu);
  return impl_->snap_adapters;
}

void Engine::pause(PauseMode mode) {
  impl_->snap_paused = true;
  impl_->post([this, mode] {
    impl_->paused = mode;
    if (mode == PauseMode::kAbort) {
      std::vector<Group*> all;
      for (auto& [id, g] : impl_->groups) all.push_back(g.get());
      for (Group* g : all) impl_->abort_group(g, FinishReason::kAbort);
    }
  });
}

void Engine::resume() {
  impl_->snap_paused = false;
  impl_->post([this] { impl_->paused.reset(); });
}

bool Engine::is_paused() const { return impl_->snap_paused; }

std::future<std::int64_t> Engine::reset_prefix_cache() {
  auto prom = std::make_shared<std::promise<std::int64_t>>();
  auto fut = prom->get_future();
  impl_->post([this, prom] { prom->set_value(impl_->bm->reset_cache()); });
  return fut;
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(impl_->snap_mu);
  EngineStats s = impl_->snap_stats;
  s.rejected_queue_full = impl_->rejected_queue_full.load();
  return s;
}

bool Engine::alive() const { return impl_->alive; }

EngineHealth Engine::health() const {
  const Impl& I = *impl_;
  EngineHealth h;
  const double now = now_seconds();
  const double started = I.step_started.load();
  h.step_running_s = started > 0 ? now - started : 0;
  h.consecutive_failures = I.consecutive_failures.load();
  double last_failure_at = 0;
  {
    std::lock_guard<std::mutex> lk(I.snap_mu);
    h.step_failures_total = I.snap_stats.step_failures;
    h.last_error = I.last_error;
    last_failure_at = I.last_failure_at;
  }
  if (!I.alive) {
    h.healthy = false;
    h.reason = "engine is not running";
  } else if (h.step_running_s > opts_.step_timeout_s) {
    h.healthy = false;
    h.reason = fmt::format("engine step has been running for {:.0f} s (--step-timeout {} s)", h.step_running_s,
                           opts_.step_timeout_s);
  } else if (opts_.max_step_failures > 0 && h.consecutive_failures >= opts_.max_step_failures &&
             now - last_failure_at < opts_.failure_cooldown_s) {
    h.healthy = false;
    h.reason = fmt::format("the last {} engine steps failed; last error: {}", h.consecutive_failures, h.last_error);
  }
  return h;
}

}  // namespace lorasync::engine
