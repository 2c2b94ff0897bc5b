// engine/engine_step.cpp: the engine thread's scheduling and its step (the batch's forward,
// sampling and delivery), members of Engine::Impl (engine_impl.h) kept out of the header so that
// no file passes ~800 lines.
#include "engine/engine_impl.h"

namespace lorasync::engine {

// ---- scheduling ------------------------------------------------------------------------
std::vector<Sched> Engine::Impl::schedule() {
  std::vector<Sched> out;
  if (paused && *paused == PauseMode::kKeep) return out;
  std::int64_t budget = opts.max_num_batched_tokens;
  std::sort(running.begin(), running.end(),
            [](const Sequence* a, const Sequence* b) { return a->arrival < b->arrival; });
  std::vector<Sequence*> order = running;
  std::vector<Sequence*> scheduled;
  for (std::size_t i = 0; i < order.size() && budget > 0; ++i) {
    Sequence* s = order[i];
    if (!s->in_running) continue;  // preempted below
    const auto T = static_cast<std::int64_t>(s->tokens.size());
    const std::int64_t n = std::min(T - s->n_computed, budget);
    if (n <= 0) continue;
    bool self_preempted = false;
    while (!ensure_blocks(s, s->n_computed + n)) {
      // Preempt the newest running sequence not already scheduled.
      Sequence* victim = nullptr;
      for (auto it = order.rbegin(); it != order.rend(); ++it)
        if ((*it)->in_running && std::find(scheduled.begin(), scheduled.end(), *it) == scheduled.end()) {
          victim = *it;
          break;
        }
      if (victim == nullptr || victim == s) {
        preempt(s);
        self_preempted = true;
        break;
      }
      preempt(victim);
    }
    if (self_preempted) continue;
    out.push_back({s, n});
    scheduled.push_back(s);
    budget -= n;
  }
  // Admission. A waiting sequence whose next uncached prompt block is being computed right now
  // by a running (or just admitted) sequence is skipped for this step: once that block is
  // registered it comes from the prefix cache (the G rollouts of a group sent as n = 1).
  const bool admit = !(paused && *paused == PauseMode::kWait);
  const std::int64_t watermark = std::max<std::int64_t>(1, bm->n_blocks() / 100);
  std::unordered_set<BlockHash, BlockHashHasher> pending;
  if (opts.enable_prefix_caching && admit && !waiting.empty())
    for (Sequence* r : running) add_pending_blocks(r, pending);
  std::size_t wi = 0;
  while (admit && wi < waiting.size() && budget > 0 &&
         static_cast<std::int64_t>(running.size()) < opts.max_num_seqs) {
    Sequence* s = waiting[wi];
    const bool fresh_leader = s->index == 0 && !s->g->cached_counted;
    if (s->blocks.empty()) lookup_prefix(s);
    const auto bs = bm->block_size();
    const auto T = static_cast<std::int64_t>(s->tokens.size());
    const auto nb = static_cast<std::int64_t>(s->blocks.size());
    if (!pending.empty() && (nb + 1) * bs <= T - 1) {
      const BlockHash& prev = s->hashes.empty() ? s->g->seed : s->hashes.back();
      if (pending.count(chain_hash(prev, s->tokens.data() + nb * bs, static_cast<std::size_t>(bs)))) {
        release_blocks(s);
        s->n_computed = 0;
        ++wi;
        continue;
      }
    }
    const std::int64_t need = (T + bs - 1) / bs - nb;
    const std::int64_t reserve = running.empty() ? 0 : watermark;
    if (bm->n_available() < need + reserve) {
      release_blocks(s);
      s->n_computed = 0;
      break;
    }
    waiting.erase(waiting.begin() + static_cast<std::ptrdiff_t>(wi));
    if (fresh_leader) {
      s->g->cached_counted = true;
      s->g->usage.cached_prompt_tokens = s->n_computed;
      st.prefix_cache_hit_tokens += s->n_computed;
    }
    const std::int64_t n = std::min(T - s->n_computed, budget);
    LS_CHECK(ensure_blocks(s, s->n_computed + n), "admission reserved the blocks");
    s->in_running = true;
    running.push_back(s);
    out.push_back({s, n});
    budget -= n;
    if (opts.enable_prefix_caching) add_pending_blocks(s, pending);
  }
  return out;
}

// ---- one step --------------------------------------------------------------------------
void Engine::Impl::step(const std::vector<Sched>& sched) {
  if (opts.before_forward) opts.before_forward(st.steps);
  const auto bs = bm->block_size();
  const c10::Device dev = model->device();
  std::vector<std::int64_t> toks, pos, slot_map;
  std::vector<int> row_slot;
  model::AttnMeta meta;
  model::Batch batch;
  bool all_decode = true;
  std::int64_t lmax = 0;
  for (const auto& sc : sched) {
    Sequence* s = sc.seq;
    model::Segment seg{static_cast<std::int64_t>(toks.size()), sc.n, s->n_computed};
    for (std::int64_t j = 0; j < sc.n; ++j) {
      const std::int64_t p = s->n_computed + j;
      toks.push_back(s->tokens[static_cast<std::size_t>(p)]);
      pos.push_back(p);
      slot_map.push_back(static_cast<std::int64_t>(s->blocks[static_cast<std::size_t>(p / bs)]) * bs + p % bs);
      row_slot.push_back(s->g->slot);
    }
    batch.segs.push_back(seg);
    if (sc.n != 1) all_decode = false;
    lmax = std::max(lmax, s->n_computed + sc.n);
  }
  // Context slots (every position of the sequence up to the new tokens), the sequences' runs
  // concatenated: ctx_lens[i] slots each.
  std::vector<std::int64_t> ctx, ctx_lens;
  for (std::size_t i = 0; i < sched.size(); ++i) {
    Sequence* s = sched[i].seq;
    const std::int64_t L = s->n_computed + sched[i].n;
    ctx_lens.push_back(L);
    for (std::int64_t p = 0; p < L; ++p)
      ctx.push_back(static_cast<std::int64_t>(s->blocks[static_cast<std::size_t>(p / bs)]) * bs + p % bs);
  }
  auto lopt = at::TensorOptions().dtype(at::kLong);
  // All-decode steps that fit a decode graph bucket run there (model/decode_graphs.h).
  model::AdapterSet graph_ads;
  bool use_graph = false;
  if (graphs && all_decode) {
    for (const auto& sl : slots) graph_ads.push_back(sl.adapter ? sl.adapter->weights : nullptr);
    use_graph = graphs->fits(static_cast<std::int64_t>(sched.size()), lmax, graph_ads);
  }
  at::NoGradGuard ng;
  at::Tensor hidden, step_logits;
  if (use_graph) {
    model::DecodeStep ds;
    ds.tokens = std::move(toks);
    ds.positions = std::move(pos);
    ds.slot_mapping = std::move(slot_map);
    ds.adapter_slot = std::move(row_slot);
    ds.lens = std::move(ctx_lens);
    ds.context = std::move(ctx);
    step_logits = graphs->run(ds, graph_ads);
    ++st.decode_graph_steps;
    st.decode_graph_captures = graphs->stats().captures;
  } else {
    hidden = forward_step(batch, meta, toks, pos, slot_map, row_slot, ctx, ctx_lens, all_decode, lmax);
  }
  // The forward pass worked: the failure streak ends before any output of this step is
  // delivered (a client that got its answer must not then see /health still failing).
  consecutive_failures = 0;

  // Which rows produce a token.
  std::vector<std::int64_t> rows;
  std::vector<Sequence*> samplers;
  for (std::size_t i = 0; i < sched.size(); ++i) {
    Sequence* s = sched[i].seq;
    st.prefill_tokens_computed +=
        std::clamp<std::int64_t>(s->n_prompt - s->n_computed, 0, sched[i].n);
    s->n_computed += sched[i].n;
    register_blocks(s);
    if (s->n_computed == static_cast<std::int64_t>(s->tokens.size())) {
      rows.push_back(batch.segs[i].begin + batch.segs[i].len - 1);
      samplers.push_back(s);
    }
  }
  if (samplers.empty()) return;
  // Forks share their leader's logits row.
  std::vector<std::int64_t> logit_rows;
  std::vector<Sequence*> targets;
  for (std::size_t i = 0; i < samplers.size(); ++i) {
    Sequence* s = samplers[i];
    logit_rows.push_back(static_cast<std::int64_t>(i));
    targets.push_back(s);
    if (s->index == 0 && !s->g->forked && s->g->spec.params.n > 1 &&
        s->n_computed == s->n_prompt) {
      const auto before = s->g->seqs.size();
      fork(s);
      for (std::size_t k = before; k < s->g->seqs.size(); ++k) {
        logit_rows.push_back(static_cast<std::int64_t>(i));
        targets.push_back(s->g->seqs[k].get());
      }
    }
  }
  at::Tensor logits;
  if (step_logits.defined()) {
    // The graph's logits cover every row of the batch: keep the sampling rows.
    bool identity = static_cast<std::int64_t>(rows.size()) == step_logits.size(0);
    for (std::size_t i = 0; identity && i < rows.size(); ++i) identity = rows[i] == static_cast<std::int64_t>(i);
    logits = identity ? step_logits : step_logits.index_select(0, at::tensor(rows, lopt).to(dev));
  } else {
    logits = model->logits(hidden.index_select(0, at::tensor(rows, lopt).to(dev)));
  }
  if (logit_rows.size() != samplers.size())
    logits = logits.index_select(0, at::tensor(logit_rows, lopt).to(dev));
  std::vector<SampleRow> srows;
  for (Sequence* s : targets) srows.push_back({&s->g->spec.params, &s->rng, &s->tokens});
  auto outs = sample_batch(logits, srows);
  const double now = now_seconds();
  for (std::size_t i = 0; i < targets.size(); ++i) append_token(targets[i], std::move(outs[i]), now);
}

// The forward of a step outside the decode graphs: the batch's tensors, the KV plan (the padded
// decode table when every row is one token) and the LoRA rows, then the model.
at::Tensor Engine::Impl::forward_step(model::Batch& batch, model::AttnMeta& meta, const std::vector<std::int64_t>& toks,
                                      const std::vector<std::int64_t>& pos, const std::vector<std::int64_t>& slot_map,
                                      const std::vector<int>& row_slot, const std::vector<std::int64_t>& ctx,
                                      const std::vector<std::int64_t>& ctx_lens, bool all_decode, std::int64_t lmax) {
  const c10::Device dev = model->device();
  auto lopt = at::TensorOptions().dtype(at::kLong);
  const std::size_t n_seqs = ctx_lens.size();
  batch.tokens = at::tensor(toks, lopt).to(dev);
  batch.positions = at::tensor(pos, lopt).to(dev);
  meta.slot_mapping = at::tensor(slot_map, lopt).to(dev);
  if (all_decode && (n_seqs > 1 || dev.is_cuda())) {
    // The padded decode table (on CUDA at batch 1 too: the paged decode kernel reads it).
    const auto B = static_cast<std::int64_t>(n_seqs);
    std::vector<std::int64_t> flat(static_cast<std::size_t>(B * lmax), 0);
    std::vector<float> bias(static_cast<std::size_t>(B * lmax), -std::numeric_limits<float>::infinity());
    const std::int64_t* c = ctx.data();
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t L = ctx_lens[static_cast<std::size_t>(b)];
      std::copy_n(c, L, flat.begin() + b * lmax);
      std::fill_n(bias.begin() + b * lmax, L, 0.f);
      c += L;
    }
    meta.decode_slots = at::tensor(flat, lopt).view({B, lmax}).to(dev);
    meta.decode_bias = at::tensor(bias, at::TensorOptions().dtype(at::kFloat)).view({B, lmax}).to(dev);
    meta.decode_lens = at::tensor(ctx_lens, lopt).to(dev);
  } else {
    const std::int64_t* c = ctx.data();
    for (std::size_t i = 0; i < n_seqs; ++i) {
      const std::int64_t L = ctx_lens[i];
      meta.context_slots.push_back(batch.segs[i].past > 0
                                       ? at::tensor(at::ArrayRef<std::int64_t>(c, static_cast<std::size_t>(L)), lopt).to(dev)
                                       : at::Tensor());
      c += L;
    }
  }
  std::vector<const model::LoraAdapter*> ads;
  for (const auto& sl : slots) ads.push_back(sl.adapter ? sl.adapter->weights.get() : nullptr);
  auto lora = model::LoraBatch::from_row_slots(ads, row_slot, dev);
  return model->forward(batch, &lora, pool.get(), &meta);
}

void Engine::Impl::append_token(Sequence* s, TokenOut t, double now) {
  Group* g = s->g;
  const auto& p = g->spec.params;
  // A sibling forked without KV (no free block) is recomputed from the prompt: it keeps the
  // token sampled here and continues after its recompute.
  s->tokens.push_back(t.id);
  ++s->n_out;
  ++st.generated_tokens_total;
  if (!g->first_token) {
    g->first_token = true;
    if (st.ttft_s.size() >= kLatencySamples) st.ttft_s.erase(st.ttft_s.begin());
    st.ttft_s.push_back(now - g->t_submit);
    st.ttft_hist.observe(now - g->t_submit);
  } else if (s->t_last > 0) {
    if (st.itl_s.size() >= kLatencySamples) st.itl_s.erase(st.itl_s.begin());
    st.itl_s.push_back(now - s->t_last);
    st.itl_hist.observe(now - s->t_last);
  }
  s->t_last = now;
  if (p.logprobs && tokenizer->is_valid_id(t.id))
    t.text = tokenizer->decode(std::span<const std::int32_t>(&t.id, 1), false);
  // Ids past the tokenizer's vocabulary (padding rows of the embedding) carry no text.
  std::string piece = tokenizer->is_valid_id(t.id) ? s->dec->push(t.id) : std::string();
  const std::size_t old_len = s->text.size();
  s->text += piece;
  FinishReason why = FinishReason::kNone;
  const bool is_stop_id =
      std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), t.id) != p.stop_token_ids.end() ||
      (!p.ignore_eos && std::find(opts.eos_ids.begin(), opts.eos_ids.end(), t.id) != opts.eos_ids.end());
  if (is_stop_id) why = FinishReason::kStop;
  if (why == FinishReason::kNone && !p.stop.empty()) {
    const std::size_t from = old_len >= g->max_stop_len ? old_len - g->max_stop_len + 1 : 0;
    std::size_t best = std::string::npos;
    for (const auto& stop : p.stop) {
      if (stop.empty()) continue;
      auto at_pos = s->text.find(stop, from);
      if (at_pos != std::string::npos) best = std::min(best, at_pos);
    }
    if (best != std::string::npos) {
      s->text.resize(best);
      why = FinishReason::kStop;
    }
  }
  if (why == FinishReason::kNone && s->n_out >= p.max_tokens) why = FinishReason::kLength;
  if (why == FinishReason::kNone && static_cast<std::int64_t>(s->tokens.size()) >= opts.max_model_len)
    why = FinishReason::kLength;
  auto& d = delta_of(g, s->index);
  d.tokens.push_back(std::move(t));
  if (why == FinishReason::kNone) {
    // Hold back text that could still become a stop string.
    const std::size_t hold = g->max_stop_len > 0 ? g->max_stop_len - 1 : 0;
    const std::size_t upto = s->text.size() > hold ? s->text.size() - hold : 0;
    if (upto > s->text_sent) {
      d.text += (s->text.substr(s->text_sent, upto - s->text_sent));
      s->text_sent = upto;
    }
  } else {
    if (why != FinishReason::kStop || is_stop_id) s->text += s->dec->flush();
    finish_seq(s, why);
    maybe_complete(g);
  }
}

}  // namespace lorasync::engine
