// engine/engine_impl.h: the engine thread's state and loop (private to engine.cpp; split out so
// that no file passes ~800 lines). See engine.h for the design.
#pragma once

#include "engine/engine.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include "core/model/decode_graphs.h"
#include "core/model/decoder_model.h"
#include "core/tokenizer/tokenizer.h"
#include "engine/block_manager.h"
#include "engine/sampler.h"
#include "util/bench_report.h"
#include "util/error.h"
#include "util/log.h"

namespace lorasync::engine {

namespace detail {

constexpr std::size_t kLatencySamples = 4096;

struct Group;

struct Sequence {
  Group* g = nullptr;
  int index = 0;
  std::vector<std::int32_t> tokens;   // prompt + output
  std::int64_t n_prompt = 0;
  std::int64_t n_computed = 0;        // tokens whose KV is in the cache
  std::vector<std::int32_t> blocks;   // block table
  std::vector<BlockHash> hashes;      // chained hashes of the full blocks registered so far
  std::mt19937_64 rng;
  std::unique_ptr<tok::IncrementalDecoder> dec;
  std::string text;                   // output text so far (after stop-string truncation)
  std::size_t text_sent = 0;
  std::int64_t n_out = 0;
  FinishReason finish = FinishReason::kNone;
  std::int64_t arrival = 0;
  bool in_running = false;
  double t_last = 0;
};

struct Group {
  RequestSpec spec;
  int slot = -1;                      // adapter slot, -1 = base model
  BlockHash seed;
  std::vector<std::unique_ptr<Sequence>> seqs;
  bool forked = false;
  bool cached_counted = false;
  int n_done = 0;
  RequestUsage usage;
  std::vector<ChoiceDelta> pending;
  double t_submit = 0;
  bool first_token = false;
  std::size_t max_stop_len = 0;
};

struct Slot {
  std::shared_ptr<const LoadedAdapter> adapter;
  std::int64_t inflight = 0;
  bool draining = false;
  // Prepared by stage_adapter, not visible until commit_adapter; reclaimable after staged_until
  // (now_seconds()).
  bool staged = false;
  double staged_until = 0;
  BlockHash seed;
  std::int64_t order = 0;
};

struct Sched {
  Sequence* seq;
  std::int64_t n;  // tokens fed this step
};

}  // namespace detail

using detail::Group;
using detail::Sequence;
using detail::Sched;
using detail::Slot;
using detail::kLatencySamples;

struct Engine::Impl {
  Impl(std::shared_ptr<const model::DecoderModel> m, std::shared_ptr<const tok::Tokenizer> t,
       const EngineOptions& o)
      : model(std::move(m)), tokenizer(std::move(t)), opts(o) {}

  std::shared_ptr<const model::DecoderModel> model;
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  EngineOptions opts;
  std::unique_ptr<model::KvPool> pool;
  std::unique_ptr<model::DecodeGraphs> graphs;  // all-decode steps (null: off); after `pool`
  std::unique_ptr<BlockManager> bm;
  BlockHash base_seed;

  // Command queue (any thread -> engine thread).
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> cmds;
  bool stopping = false;
  std::thread thread;
  std::atomic<bool> alive{false};
  std::atomic<std::int64_t> queued_seqs{0};   // sequences submitted and not completed
  std::atomic<std::int64_t> rejected_queue_full{0};
  // Health: the current step's start (steady seconds, 0 between steps) and failures.
  std::atomic<double> step_started{0};
  std::atomic<std::int64_t> consecutive_failures{0};
  double last_failure_at = 0;                 // snap_mu
  std::string last_error;                     // snap_mu

  // Engine-thread state.
  std::unordered_map<std::string, std::unique_ptr<Group>> groups;
  std::deque<Sequence*> waiting;
  std::vector<Sequence*> running;
  std::vector<Slot> slots;
  std::int64_t arrivals = 0, load_counter = 0;
  std::optional<PauseMode> paused;
  EngineStats st;

  // Snapshots for other threads.
  mutable std::mutex snap_mu;
  std::vector<AdapterInfo> snap_adapters;
  std::int64_t snap_staged = 0;
  EngineStats snap_stats;
  std::atomic<bool> snap_paused{false};

  void post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lk(mu);
      cmds.push_back(std::move(f));
    }
    cv.notify_one();
  }

  // ---- snapshots -------------------------------------------------------------------------
  void publish_adapters() {
    std::vector<std::pair<std::int64_t, AdapterInfo>> v;
    for (const auto& s : slots)
      if (s.adapter && !s.draining && !s.staged)
        v.push_back({s.order, {s.adapter->name, s.adapter->path, s.adapter->sha256,
                               s.adapter->weights->config().rank}});
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::int64_t staged = 0;
    for (const auto& s : slots) staged += s.staged ? 1 : 0;
    std::lock_guard<std::mutex> lk(snap_mu);
    snap_staged = staged;
    snap_adapters.clear();
    for (auto& [o, a] : v) snap_adapters.push_back(std::move(a));
  }

  void publish_stats() {
    st.running = static_cast<std::int64_t>(running.size());
    st.waiting = static_cast<std::int64_t>(waiting.size());
    st.kv_blocks_total = bm->n_blocks();
    st.kv_blocks_used = bm->n_used();
    st.kv_blocks_cached = bm->n_cached();
    std::lock_guard<std::mutex> lk(snap_mu);
    snap_stats = st;
  }

  int find_slot(const std::string& name, bool include_draining) const {
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (slots[i].adapter && !slots[i].staged && slots[i].adapter->name == name &&
          (include_draining || !slots[i].draining))
        return static_cast<int>(i);
    return -1;
  }
  int find_staged(const std::string& name) const;  // engine.cpp
  // A slot for a new adapter: an empty one, else a drained one, else a staged one whose commit
  // never came (past staged_until). -1 when none.
  int free_slot(double now) const;  // engine.cpp

  // ---- blocks ----------------------------------------------------------------------------
  bool ensure_blocks(Sequence* s, std::int64_t upto) {
    const auto bs = bm->block_size();
    while (static_cast<std::int64_t>(s->blocks.size()) * bs < upto) {
      auto b = bm->allocate();
      if (!b) return false;
      s->blocks.push_back(*b);
    }
    return true;
  }

  void release_blocks(Sequence* s) {
    for (auto b : s->blocks) bm->release(b);
    s->blocks.clear();
    s->hashes.clear();
  }

  // Registers every full block of computed tokens not registered yet.
  void register_blocks(Sequence* s) {
    const auto bs = bm->block_size();
    while (static_cast<std::int64_t>(s->hashes.size() + 1) * bs <= s->n_computed) {
      const auto i = static_cast<std::int64_t>(s->hashes.size());
      const BlockHash& prev = s->hashes.empty() ? s->g->seed : s->hashes.back();
      auto h = chain_hash(prev, s->tokens.data() + i * bs, static_cast<std::size_t>(bs));
      bm->register_full(s->blocks[static_cast<std::size_t>(i)], h);
      s->hashes.push_back(h);
    }
  }

  // Prefix-cache lookup for a sequence with no KV: full blocks of tokens[0, T-1).
  void lookup_prefix(Sequence* s) {
    const auto bs = bm->block_size();
    const auto T = static_cast<std::int64_t>(s->tokens.size());
    BlockHash prev = s->g->seed;
    while ((static_cast<std::int64_t>(s->blocks.size()) + 1) * bs <= T - 1) {
      const auto i = static_cast<std::int64_t>(s->blocks.size());
      auto h = chain_hash(prev, s->tokens.data() + i * bs, static_cast<std::size_t>(bs));
      auto b = bm->lookup(h);
      if (!b) break;
      s->blocks.push_back(*b);
      s->hashes.push_back(h);
      prev = h;
    }
    s->n_computed = static_cast<std::int64_t>(s->blocks.size()) * bs;
  }

  // Hashes of the full prompt blocks `s` has still to compute (those a later prefix-cache lookup
  // would find once registered).
  void add_pending_blocks(Sequence* s, std::unordered_set<BlockHash, BlockHashHasher>& out) const {
    const auto bs = bm->block_size();
    const auto limit = std::min<std::int64_t>(s->n_prompt, static_cast<std::int64_t>(s->tokens.size()) - 1) / bs;
    BlockHash prev = s->hashes.empty() ? s->g->seed : s->hashes.back();
    for (auto i = static_cast<std::int64_t>(s->hashes.size()); i < limit; ++i) {
      prev = chain_hash(prev, s->tokens.data() + i * bs, static_cast<std::size_t>(bs));
      out.insert(prev);
    }
  }

  void preempt(Sequence* s) {
    release_blocks(s);
    s->n_computed = 0;
    s->in_running = false;
    running.erase(std::remove(running.begin(), running.end(), s), running.end());
    waiting.push_front(s);
    ++st.preemptions;
  }

  // ---- requests --------------------------------------------------------------------------
  void deliver(Group* g, bool done) {
    if (g->pending.empty() && !done) return;
    g->usage.completion_tokens = 0;
    for (const auto& s : g->seqs) g->usage.completion_tokens += s->n_out;
    auto deltas = std::move(g->pending);
    g->pending.clear();
    if (g->spec.sink) g->spec.sink->on_output(std::move(deltas), g->usage, done);
  }

  ChoiceDelta& delta_of(Group* g, int index) {
    for (auto& d : g->pending)
      if (d.index == index) return d;
    g->pending.push_back(ChoiceDelta{});
    g->pending.back().index = index;
    return g->pending.back();
  }

  void finish_seq(Sequence* s, FinishReason why, const std::string& error = {}) {
    if (s->finish != FinishReason::kNone) return;
    s->finish = why;
    Group* g = s->g;
    auto& d = delta_of(g, s->index);
    if (s->text_sent < s->text.size()) d.text += (s->text.substr(s->text_sent));
    s->text_sent = s->text.size();
    d.finish = why;
    d.error = error;
    d.internal = why == FinishReason::kError;  // the request's own errors never reach a sequence
    release_blocks(s);
    if (s->in_running) {
      running.erase(std::remove(running.begin(), running.end(), s), running.end());
      s->in_running = false;
    }
    waiting.erase(std::remove(waiting.begin(), waiting.end(), s), waiting.end());
    ++g->n_done;
  }

  // Finishes a group if all its sequences are done; returns true if the group was erased.
  bool maybe_complete(Group* g) {
    // Choices not forked yet do not exist; abort_group accounts for them.
    if (!g->forked && g->spec.params.n > 1) return false;
    if (g->n_done < g->spec.params.n) return false;
    bool aborted = false;
    for (const auto& s : g->seqs) aborted |= s->finish == FinishReason::kAbort;
    if (aborted) ++st.requests_aborted;
    else ++st.requests_finished;
    if (g->slot >= 0) {
      Slot& sl = slots[static_cast<std::size_t>(g->slot)];
      if (--sl.inflight == 0 && sl.draining) {
        sl.adapter.reset();
        sl.draining = false;
      }
    }
    LS_LOG_DEBUG("engine", "{} complete", g->spec.id);
    queued_seqs -= g->spec.params.n;
    const std::string id = g->spec.id;
    try {
      deliver(g, true);
    } catch (const std::exception& e) {
      LS_LOG_ERROR("engine", "{}: delivering its last output failed: {}", id, e.what());
    }
    groups.erase(id);
    return true;
  }

  void abort_group(Group* g, FinishReason why, const std::string& error = {}) {
    // Children not yet forked never existed: report every choice as ended.
    if (!g->forked && g->spec.params.n > 1) {
      for (int j = 1; j < g->spec.params.n; ++j) {
        auto& d = delta_of(g, j);
        d.finish = why;
        d.error = error;
        d.internal = why == FinishReason::kError;
      }
      g->n_done += g->spec.params.n - 1;
      g->forked = true;
    }
    for (auto& s : g->seqs) finish_seq(s.get(), why, error);
    maybe_complete(g);
  }

  void add_request(RequestSpec spec) {
    auto g = std::make_unique<Group>();
    g->t_submit = now_seconds();
    if (spec.model != opts.served_model_name) {
      g->slot = find_slot(spec.model, false);
      if (g->slot < 0) {
        ChoiceDelta d;
        d.finish = FinishReason::kError;
        d.error = fmt::format("The model `{}` does not exist.", spec.model);
        queued_seqs -= spec.params.n;
        if (spec.sink) spec.sink->on_output({d}, {}, true);
        return;
      }
      Slot& sl = slots[static_cast<std::size_t>(g->slot)];
      ++sl.inflight;
      g->seed = sl.seed;
    } else {
      g->seed = base_seed;
    }
    for (const auto& s : spec.params.stop) g->max_stop_len = std::max(g->max_stop_len, s.size());
    g->usage.prompt_tokens = static_cast<std::int64_t>(spec.prompt.size());
    ++st.requests_total;
    st.prompt_tokens_total += g->usage.prompt_tokens;
    ++st.requests_by_model[spec.model];
    g->spec = std::move(spec);
    auto s = make_seq(g.get(), 0);
    s->tokens = g->spec.prompt;
    waiting.push_back(s);
    Group* raw = g.get();
    if (groups.count(raw->spec.id)) raw->spec.id += "-" + std::to_string(arrivals);
    groups.emplace(raw->spec.id, std::move(g));
  }

  Sequence* make_seq(Group* g, int index) {
    auto s = std::make_unique<Sequence>();
    s->g = g;
    s->index = index;
    s->n_prompt = static_cast<std::int64_t>(g->spec.prompt.size());
    s->arrival = ++arrivals;
    const auto& p = g->spec.params;
    if (p.seed) s->rng.seed(*p.seed + static_cast<std::uint64_t>(index));
    else s->rng.seed(std::random_device{}() ^ (static_cast<std::uint64_t>(s->arrival) << 32));
    s->dec = std::make_unique<tok::IncrementalDecoder>(*tokenizer, p.skip_special_tokens);
    Sequence* raw = s.get();
    g->seqs.push_back(std::move(s));
    return raw;
  }

  // Forks the n-1 siblings of a leader that just computed its whole prompt.
  void fork(Sequence* leader) {
    Group* g = leader->g;
    g->forked = true;
    const auto bs = bm->block_size();
    const std::int64_t full = leader->n_prompt / bs;
    const std::int64_t part = leader->n_prompt % bs;
    for (int j = 1; j < g->spec.params.n; ++j) {
      Sequence* s = make_seq(g, j);
      s->arrival = leader->arrival;
      s->tokens = leader->tokens;
      bool ok = true;
      for (std::int64_t i = 0; i < full; ++i) {
        bm->ref(leader->blocks[static_cast<std::size_t>(i)]);
        s->blocks.push_back(leader->blocks[static_cast<std::size_t>(i)]);
      }
      s->hashes.assign(leader->hashes.begin(),
                       leader->hashes.begin() + std::min<std::size_t>(leader->hashes.size(), static_cast<std::size_t>(full)));
      if (part > 0) {
        auto b = bm->allocate();
        if (b) {
          copy_block_rows(leader->blocks[static_cast<std::size_t>(full)], *b, part);
          s->blocks.push_back(*b);
        } else {
          ok = false;
        }
      }
      if (ok) {
        s->n_computed = leader->n_prompt;
        s->in_running = true;
        running.push_back(s);
      } else {
        release_blocks(s);
        s->n_computed = 0;
        waiting.push_front(s);
      }
      st.fork_shared_tokens += ok ? leader->n_prompt : full * bs;
    }
  }

  void copy_block_rows(std::int32_t src, std::int32_t dst, std::int64_t rows) {
    const auto bs = bm->block_size();
    for (std::size_t l = 0; l < pool->k.size(); ++l) {
      pool->k[l].narrow(0, dst * bs, rows).copy_(pool->k[l].narrow(0, src * bs, rows));
      pool->v[l].narrow(0, dst * bs, rows).copy_(pool->v[l].narrow(0, src * bs, rows));
    }
  }

  // ---- scheduling and one step (engine_step.cpp) -----------------------------------------
  std::vector<Sched> schedule();
  void step(const std::vector<Sched>& sched);
  at::Tensor forward_step(model::Batch& batch, model::AttnMeta& meta, const std::vector<std::int64_t>& toks,
                          const std::vector<std::int64_t>& pos, const std::vector<std::int64_t>& slot_map,
                          const std::vector<int>& row_slot, const std::vector<std::int64_t>& ctx,
                          const std::vector<std::int64_t>& ctx_lens, bool all_decode, std::int64_t lmax);
  void append_token(Sequence* s, TokenOut t, double now);

  // ---- the loop --------------------------------------------------------------------------
  bool runnable() const {
    if (paused && *paused == PauseMode::kKeep) return false;
    if (!running.empty()) return true;
    return !waiting.empty() && !(paused && *paused == PauseMode::kWait);
  }

  // Every group still in the engine ends with an engine error (after a failure outside a step).
  void fail_all(const std::string& why) {
    std::vector<std::string> ids;
    for (auto& [id, g] : groups) ids.push_back(id);
    fail_groups(ids, why);
  }

  // Ends the named groups that still exist with an internal error. By id, not by pointer: ending
  // one group can erase another's sequences (a failed step's schedule holds sequences of groups
  // that an earlier abort in the same loop completed).
  void fail_groups(const std::vector<std::string>& ids, const std::string& why) {
    for (const auto& id : ids) {
      auto it = groups.find(id);
      if (it == groups.end()) continue;
      Group* g = it->second.get();
      try {
        abort_group(g, FinishReason::kError, why);  // may erase g
      } catch (const std::exception& e) {
        // The sink itself failed: end the group again without telling it more (a null sink
        // is never called; finished sequences are skipped).
        LS_LOG_ERROR("engine", "{}: ending it failed too ({}); dropped", id, e.what());
        auto again = groups.find(id);
        if (again == groups.end()) continue;
        again->second->spec.sink.reset();
        try {
          abort_group(again->second.get(), FinishReason::kError, why);
        } catch (const std::exception& e2) {
          LS_LOG_ERROR("engine", "{}: could not be ended: {}", id, e2.what());
        }
      }
    }
  }

  void note_step_failure(const std::string& what) {
    ++st.step_failures;
    ++consecutive_failures;
    std::lock_guard<std::mutex> lk(snap_mu);
    last_failure_at = now_seconds();
    last_error = what;
  }

  // One scheduled step and the delivery of its outputs. Throws only for failures outside the
  // forward pass (scheduling, delivery); the step's own failure ends its groups here.
  void iterate() {
    auto sched = schedule();
    if (!sched.empty()) {
      std::vector<std::string> ids;
      for (const auto& sc : sched)
        if (std::find(ids.begin(), ids.end(), sc.seq->g->spec.id) == ids.end()) ids.push_back(sc.seq->g->spec.id);
      step_started = now_seconds();
      try {
        step(sched);
        step_started = 0;
        consecutive_failures = 0;
      } catch (const std::exception& e) {
        step_started = 0;
        LS_LOG_ERROR("engine", "step {} failed, failing its {} request(s): {}", st.steps, ids.size(), e.what());
        note_step_failure(e.what());
        fail_groups(ids, std::string("engine error: ") + e.what());
      }
      ++st.steps;
    }
    // Deliver outputs of every group touched in this step; a sink that throws ends its group.
    std::vector<std::string> broken;
    for (auto& [id, g] : groups) {
      try {
        deliver(g.get(), false);
      } catch (const std::exception& e) {
        LS_LOG_ERROR("engine", "{}: delivering output failed: {}", id, e.what());
        broken.push_back(id);
      }
    }
    for (const auto& id : broken) {
      auto it = groups.find(id);
      if (it != groups.end()) it->second->spec.sink.reset();
    }
    fail_groups(broken, "engine error: output delivery failed");
  }

  void loop() {
    for (;;) {
      std::deque<std::function<void()>> batch;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stopping || !cmds.empty() || runnable(); });
        if (stopping) break;
        batch.swap(cmds);
      }
      // Nothing that throws may leave this loop: an escaping exception would end the process.
      for (auto& f : batch) {
        try {
          f();
        } catch (const std::exception& e) {
          ++st.command_failures;
          LS_LOG_ERROR("engine", "a command failed: {}", e.what());
        }
      }
      try {
        if (runnable()) iterate();
      } catch (const std::exception& e) {
        step_started = 0;
        LS_LOG_ERROR("engine", "engine iteration failed, failing every request in the engine: {}", e.what());
        note_step_failure(e.what());
        try {
          fail_all(std::string("engine error: ") + e.what());
        } catch (const std::exception& e2) {
          LS_LOG_ERROR("engine", "failing the requests failed too: {}", e2.what());
        }
      }
      try {
        publish_stats();
      } catch (const std::exception& e) {
        LS_LOG_ERROR("engine", "publishing stats failed: {}", e.what());
      }
    }
    // Shutdown: abort everything still queued or running.
    std::vector<Group*> all;
    for (auto& [id, g] : groups) all.push_back(g.get());
    for (Group* g : all) {
      try {
        abort_group(g, FinishReason::kAbort);
      } catch (const std::exception& e) {
        LS_LOG_ERROR("engine", "aborting {} at shutdown failed: {}", g->spec.id, e.what());
      }
    }
    alive = false;
  }
};

}  // namespace lorasync::engine
