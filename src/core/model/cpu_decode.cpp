// Small steps on our CPU kernels (decoder_model.h, set_cpu_fast_paths): the same layer maths as
// DecoderModel::forward, with the small per-token steps fused into single loops, q/k/v and gate/up
// each computed in one pass over their weights, decode rows' attention reading the paged KV cache
// in place (a mixed step's prefill chunks use our blocked causal kernel), and LoRA deltas with
// the maths of LoraBatch::apply on our kernels (project: folded into the projections for decode-sized
// steps; lora_into above 64 rows).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "core/model/cpu_kernels.h"
#include "core/model/decoder_model.h"
#include "util/error.h"

namespace lorasync::model {

namespace {

std::atomic<bool> g_fast{true};

bool fp32_cpu_contiguous(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

// Up to this many rows our kernels (cpu::linear) run the products; above, BLAS. Decode tok/s on
// the small preset, 2 threads, MKL (the wheel's BLAS) vs ours with AVX2 tiles: 512 vs 690 at 128
// rows, 538 vs 662 at 256, 611 vs 629 at 512 (the LM head on BLAS in both at 512). With AVX-512
// tiles ours runs every step of the fast path (kernel_max_rows): MKL stays on AVX2 on AMD's CPUs.
constexpr std::int64_t kKernelMaxRows = 512;
// Steps of up to this many tokens (decode rows, prefill chunks, mixed steps) take the fast path
// (its elementwise steps split large batches over the threads too); above, the libtorch path.
constexpr std::int64_t kFastPathMaxTokens = 4096;

std::int64_t kernel_max_rows() { return cpu::avx512_in_use() ? kFastPathMaxTokens : kKernelMaxRows; }

// y [M, N] = x w^T (+ bias) through BLAS, into y.
void blas_linear_into(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  if (bias != nullptr) {
    auto b = at::from_blob(const_cast<float*>(bias), {w.size(0)}, at::TensorOptions().dtype(at::kFloat));
    at::addmm_out(y, b, x, w.t());
  } else {
    at::mm_out(y, x, w.t());
  }
}

// One output of a linear: y = x w^T (+ bias).
struct Proj {
  const at::Tensor* w;
  const at::Tensor* bias;  // may be null
  at::Tensor* y;
};

// Every projection of `projs` shares x [M, K]: our kernel (one parallel region, each weight read
// once) for a few rows, BLAS above.
void linear_into(const at::Tensor& x, std::initializer_list<Proj> projs) {
  const auto M = x.size(0), K = x.size(1);
  if (M > kernel_max_rows()) {
    for (const auto& p : projs) blas_linear_into(x, *p.w, p.bias ? p.bias->data_ptr<float>() : nullptr, *p.y);
    return;
  }
  std::vector<cpu::LinearOut> parts;
  parts.reserve(projs.size());
  for (const auto& p : projs)
    parts.push_back({p.w->data_ptr<float>(), p.bias ? p.bias->data_ptr<float>() : nullptr, p.w->size(0),
                     p.y->data_ptr<float>(), p.y->size(1)});
  cpu::linear(x.data_ptr<float>(), M, K, K, parts);
}

void add_into(at::Tensor& h, const at::Tensor& y) {
  float* hp = h.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const auto n = h.numel();
  for (std::int64_t i = 0; i < n; ++i) hp[i] += yp[i];
}

// One LoRA-targeted output: y += the deltas of module m.
struct LoraOut {
  at::Tensor* y;
  LoraModule m;
};

// A step's LoRA batch on our kernels: each part's rows as int64 on the CPU, checked against the
// batch once per step; `ours` false (an adapter not fp32 on the CPU): the libtorch path.
struct LoraPlan {
  const LoraBatch* lora = nullptr;
  std::vector<at::Tensor> rows;               // per part; undefined: every row of the batch
  std::vector<const std::int64_t*> row_ptrs;  // null: every row
  std::vector<std::int64_t> n_rows;
  bool ours = true;

  LoraPlan(const LoraBatch& l, std::int64_t M) : lora(&l) {
    for (const auto& part : l.parts()) {
      for (std::int64_t layer = 0; layer < part.adapter->n_layers() && ours; ++layer)
        for (auto m : part.adapter->config().targets)
          if (!fp32_cpu_contiguous(part.adapter->A(layer, m)) || !fp32_cpu_contiguous(part.adapter->B(layer, m)))
            ours = false;
      if (part.rows.defined() && !part.rows.device().is_cpu()) ours = false;
    }
    if (!ours) return;
    for (const auto& part : l.parts()) {
      at::Tensor r;
      const std::int64_t* ri = nullptr;
      std::int64_t R = M;
      if (part.rows.defined()) {
        r = part.rows.to(at::kLong).contiguous();
        R = r.numel();
        ri = r.data_ptr<std::int64_t>();
        for (std::int64_t i = 0; i < R; ++i)
          if (ri[i] < 0 || ri[i] >= M) throw_invalid("LoRA row {} outside the batch of {}", ri[i], M);
      }
      rows.push_back(std::move(r));
      row_ptrs.push_back(ri);
      n_rows.push_back(R);
    }
  }
};

// The LoRA deltas of every adapter of the batch for outputs that share the input x, with the
// maths of LoraBatch::apply (y += s * B (A x) per row) in one cpu::lora_deltas call: two parallel
// regions whatever the number of adapters and targeted modules. (LoraBatch::apply spends ~5
// dispatcher round trips per adapter, module and layer; one region per product, as before this,
// cost 1.4x the base model's step with 5 adapters of rank 8 at 16 streams.)
void lora_into(const LoraPlan& plan, const at::Tensor& x, std::int64_t layer, std::initializer_list<LoraOut> outs) {
  const LoraBatch& lora = *plan.lora;
  if (!plan.ours) {
    for (const auto& o : outs) *o.y = lora.apply(x, *o.y, layer, o.m).contiguous();
    return;
  }
  const auto in = x.size(1);
  std::vector<cpu::LoraDelta> deltas;
  for (std::size_t pi = 0; pi < lora.parts().size(); ++pi) {
    const auto& adapter = *lora.parts()[pi].adapter;
    for (const auto& o : outs) {
      if (!adapter.config().targets_module(o.m)) continue;
      const auto& A = adapter.A(layer, o.m);
      deltas.push_back({A.data_ptr<float>(), adapter.B(layer, o.m).data_ptr<float>(), A.size(0),
                        static_cast<float>(adapter.config().scaling()), plan.row_ptrs[pi], plan.n_rows[pi],
                        o.y->data_ptr<float>(), o.y->size(1), o.y->size(1)});
    }
  }
  if (!deltas.empty()) cpu::lora_deltas(x.data_ptr<float>(), in, in, deltas);
}

// Up to this many rows the adapters' A products join the base projections' parallel region and
// the B products follow on this thread (cpu::lora_b_updates): a decode step's LoRA adds no
// parallel region. The A products are computed for every row of the batch, not only their
// adapter's rows: (adapters - 1) x the A work needed, a few percent of the base weights' work at
// these sizes, and cheaper than a region. (5 adapters of rank 8 at 16 rows: lora_into's two
// regions per call took 1.8 ms of a 34 ms step in `bench forward`, and 6.3 ms of the engine's
// 20 ms forward in `bench serve`, where other threads compete for the cores at every barrier.)
// Above, lora_into's gathered path.
constexpr std::int64_t kFoldedLoraRows = 64;

// linear_into(x, projs), and the LoRA deltas of `outs` (the same outputs) when plan is set.
void project(const at::Tensor& x, std::initializer_list<Proj> projs, const LoraPlan* plan, std::int64_t layer,
             std::initializer_list<LoraOut> outs) {
  const auto M = x.size(0);
  if (plan == nullptr || !plan->ours || M > kFoldedLoraRows) {
    linear_into(x, projs);
    if (plan) lora_into(*plan, x, layer, outs);
    return;
  }
  const LoraBatch& lora = *plan->lora;
  // t [M, sum of ranks]: A x of every (part, targeted output), side by side.
  struct Slot {
    std::size_t part;
    const LoraOut* out;
    std::int64_t off;
  };
  std::vector<Slot> slots;
  std::int64_t width = 0;
  for (std::size_t pi = 0; pi < lora.parts().size(); ++pi)
    for (const auto& o : outs)
      if (lora.parts()[pi].adapter->config().targets_module(o.m)) {
        slots.push_back({pi, &o, width});
        width += lora.parts()[pi].adapter->A(layer, o.m).size(0);
      }
  thread_local std::vector<float> t;
  t.resize(static_cast<std::size_t>(M * width));
  std::vector<cpu::LinearOut> parts;
  for (const auto& p : projs)
    parts.push_back({p.w->data_ptr<float>(), p.bias ? p.bias->data_ptr<float>() : nullptr, p.w->size(0),
                     p.y->data_ptr<float>(), p.y->size(1)});
  std::vector<cpu::LoraBUpdate> updates;
  for (const auto& sl : slots) {
    const auto& adapter = *lora.parts()[sl.part].adapter;
    const auto& A = adapter.A(layer, sl.out->m);
    float* ts = t.data() + sl.off;
    parts.push_back({A.data_ptr<float>(), nullptr, A.size(0), ts, width});
    updates.push_back({ts, width, adapter.B(layer, sl.out->m).data_ptr<float>(), A.size(0),
                       static_cast<float>(adapter.config().scaling()), plan->row_ptrs[sl.part], plan->n_rows[sl.part],
                       sl.out->y->data_ptr<float>(), sl.out->y->size(1), sl.out->y->size(1)});
  }
  cpu::linear(x.data_ptr<float>(), M, x.size(1), x.size(1), parts);
  cpu::lora_b_updates(updates);
}

// The LM head's output, [rows, vocab] fp32, in a buffer this thread reuses once its caller has let
// go of the previous one (no other reference to its storage). A fresh buffer of a batch-64 step on
// the Qwen2 vocabulary is 39 MB, above glibc's largest mmap threshold, so every step mapped it anew
// and the kernel faulted in and zeroed every page: about 5% of the step. Buffers up to
// kReusedLogitsBytes are kept (one per thread); larger ones are allocated per call.
constexpr std::int64_t kReusedLogitsBytes = std::int64_t{128} << 20;

at::Tensor reusable_logits(std::int64_t rows, std::int64_t vocab) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const std::int64_t need = rows * vocab;
  if (need * static_cast<std::int64_t>(sizeof(float)) > kReusedLogitsBytes) return at::empty({rows, vocab}, f32);
  thread_local at::Tensor buf;
  if (!buf.defined() || buf.storage().use_count() != 1 || buf.numel() < need) buf = at::empty({need}, f32);
  return buf.narrow(0, 0, need).view({rows, vocab});
}

}  // namespace

at::Tensor empty_cpu_huge_pages(at::IntArrayRef shape, c10::ScalarType dtype) {
  auto opts = at::TensorOptions().dtype(dtype);
  std::int64_t numel = 1;
  for (auto s : shape) numel *= s;
  const auto bytes = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  if (bytes < kHuge) return at::empty(shape, opts);
#if defined(__linux__)
  const std::size_t span = (bytes + kHuge - 1) / kHuge * kHuge;
  const std::size_t len = span + kHuge;  // room to align the start to a huge page
  void* raw = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return at::empty(shape, opts);
  const auto base = (reinterpret_cast<std::uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge;
  // Only the whole huge pages: the tail stays in small pages, so no tensor wastes up to 2 MiB of
  // resident memory on a partly used huge page. Advice only: a refusal leaves small pages.
  (void)::madvise(reinterpret_cast<void*>(base), bytes / kHuge * kHuge, MADV_HUGEPAGE);
  return at::from_blob(reinterpret_cast<void*>(base), shape, [raw, len](void*) { ::munmap(raw, len); }, opts);
#else
  return at::empty(shape, opts);
#endif
}

bool set_cpu_fast_paths(bool on) { return g_fast.exchange(on); }
bool cpu_fast_paths() { return g_fast.load(std::memory_order_relaxed); }

bool DecoderModel::cpu_decode_applies(const Batch& batch, const KvPool* kv, const AttnMeta* meta) const {
  if (!cpu_fast_paths() || kv == nullptr || meta == nullptr) return false;
  if (!device_.is_cpu() || dtype_ != at::kFloat || c10::GradMode::is_enabled()) return false;
  const auto T = batch.n_tokens();
  const auto n_segs = static_cast<std::int64_t>(batch.segs.size());
  if (n_segs == 0 || T > kFastPathMaxTokens) return false;
  if (!batch.tokens.device().is_cpu() || !batch.positions.device().is_cpu()) return false;
  if (kv->k.size() != layers_.size() || kv->v.size() != layers_.size()) return false;
  for (std::size_t l = 0; l < layers_.size(); ++l)
    if (!fp32_cpu_contiguous(kv->k[l]) || !fp32_cpu_contiguous(kv->v[l])) return false;
  if (meta->decode_slots.defined())  // the padded table comes only with all-decode batches
    return meta->decode_slots.dim() == 2 && meta->decode_slots.size(0) == n_segs && T == n_segs;
  if (static_cast<std::int64_t>(meta->context_slots.size()) != n_segs) return false;
  for (std::int64_t i = 0; i < n_segs; ++i) {
    const auto& s = batch.segs[static_cast<std::size_t>(i)];
    if (s.past > 0 && !meta->context_slots[static_cast<std::size_t>(i)].defined()) return false;
  }
  return true;
}

at::Tensor DecoderModel::forward_cpu_decode(const Batch& batch, const LoraBatch* lora, KvPool& kv,
                                          const AttnMeta& meta) const {
  const auto B = batch.n_tokens();  // rows (tokens) of the batch
  const auto d = cfg_.hidden_size, I = cfg_.intermediate_size, V = cfg_.vocab_size;
  const auto nh = cfg_.num_attention_heads, nkv = cfg_.num_key_value_heads, hd = cfg_.head_dim;
  const auto qd = cfg_.q_dim(), kvd = cfg_.kv_dim();
  const auto n_slots = kv.n_slots();
  const float eps = static_cast<float>(cfg_.rms_norm_eps);

  auto tokens = batch.tokens.to(at::kLong).contiguous();
  auto positions = batch.positions.to(at::kLong).contiguous();
  auto slot_map = meta.slot_mapping.to(at::kCPU).to(at::kLong).contiguous();
  LS_CHECK(slot_map.numel() == B, "slot_mapping has {} entries for {} tokens", slot_map.numel(), B);
  const std::int64_t* tok = tokens.data_ptr<std::int64_t>();
  const std::int64_t* pos = positions.data_ptr<std::int64_t>();
  const std::int64_t* sm = slot_map.data_ptr<std::int64_t>();
  for (std::int64_t b = 0; b < B; ++b)
    if (sm[b] < 0 || sm[b] >= n_slots) throw_invalid("token {}: slot {} outside the pool of {}", b, sm[b], n_slots);

  // Segments of one new token (decode) go to our attention kernel with their context's slots,
  // checked against the pool once per step (the kernel reads the pool in place); longer ones
  // (prefill chunks of a mixed step) to our blocked causal kernel (cpu::causal_attention), or
  // libtorch's fused attention where that kernel does not apply.
  std::vector<at::Tensor> keep;
  std::vector<const std::int64_t*> slots;
  std::vector<std::int64_t> lens, dec_rows;
  std::vector<std::size_t> chunk_segs;
  at::Tensor ds;
  if (meta.decode_slots.defined()) ds = meta.decode_slots.to(at::kCPU).to(at::kLong).contiguous();
  for (std::size_t i = 0; i < batch.segs.size(); ++i) {
    const auto& seg = batch.segs[i];
    if (seg.len != 1) {
      chunk_segs.push_back(i);
      continue;
    }
    const auto b = static_cast<std::int64_t>(i);
    const std::int64_t L = seg.past + 1;
    const std::int64_t* p = nullptr;
    if (ds.defined()) {
      if (L > ds.size(1)) throw_invalid("decode sequence {} needs {} context slots, the plan has {}", b, L, ds.size(1));
      p = ds.data_ptr<std::int64_t>() + b * ds.size(1);
    } else if (seg.past == 0 && !meta.context_slots[i].defined()) {
      p = sm + seg.begin;  // a one-token prompt: its context is its own new slot (the engine sends none)
    } else {
      auto c = meta.context_slots[i].to(at::kCPU).to(at::kLong).contiguous();
      if (c.numel() != L) throw_invalid("decode sequence {} has {} context slots for {} positions", b, c.numel(), L);
      p = c.data_ptr<std::int64_t>();
      keep.push_back(std::move(c));
    }
    for (std::int64_t j = 0; j < L; ++j)
      if (p[j] < 0 || p[j] >= n_slots) throw_invalid("decode sequence {}: slot {} outside the pool of {}", b, p[j], n_slots);
    if (p[L - 1] != sm[seg.begin])
      throw_invalid("decode sequence {}: its new token's slot {} is not its context's last ({})", b, sm[seg.begin], p[L - 1]);
    slots.push_back(p);
    lens.push_back(L);
    dec_rows.push_back(seg.begin);
  }

  auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto h = at::empty({B, d}, f32);
  const float* emb = embed_.data_ptr<float>();
  for (std::int64_t b = 0; b < B; ++b) {
    if (tok[b] < 0 || tok[b] >= V) throw_invalid("token id {} outside the vocabulary of {}", tok[b], V);
    std::memcpy(h.data_ptr<float>() + b * d, emb + tok[b] * d, static_cast<std::size_t>(d) * sizeof(float));
  }
  const float* inv_freq = inv_freq_.data_ptr<float>();
  std::optional<LoraPlan> plan;
  if (lora) plan.emplace(*lora, B);
  const LoraPlan* lp = plan ? &*plan : nullptr;
  auto x = at::empty({B, d}, f32);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& Ly = layers_[l];
    const auto li = static_cast<std::int64_t>(l);
    cpu::rms_norm(h.data_ptr<float>(), Ly.input_norm.data_ptr<float>(), eps, B, d, x.data_ptr<float>());
    auto q = at::empty({B, qd}, f32), k = at::empty({B, kvd}, f32), v = at::empty({B, kvd}, f32);
    auto bias = [](const at::Tensor& b) { return b.defined() ? &b : nullptr; };
    project(x, {{&Ly.q_w, bias(Ly.q_b), &q}, {&Ly.k_w, bias(Ly.k_b), &k}, {&Ly.v_w, bias(Ly.v_b), &v}}, lp, li,
            {{&q, LoraModule::kQ}, {&k, LoraModule::kK}, {&v, LoraModule::kV}});
    if (cfg_.qk_norm) {  // each head's row of head_dim, in place (the kernel reads a row before writing it)
      cpu::rms_norm(q.data_ptr<float>(), Ly.q_norm.data_ptr<float>(), eps, B * nh, hd, q.data_ptr<float>());
      cpu::rms_norm(k.data_ptr<float>(), Ly.k_norm.data_ptr<float>(), eps, B * nkv, hd, k.data_ptr<float>());
    }
    cpu::rope(q.data_ptr<float>(), B, qd, nh, hd, pos, inv_freq);
    cpu::rope(k.data_ptr<float>(), B, kvd, nkv, hd, pos, inv_freq);
    float* kp = kv.k[l].data_ptr<float>();
    float* vp = kv.v[l].data_ptr<float>();
    for (std::int64_t b = 0; b < B; ++b) {
      std::memcpy(kp + sm[b] * kvd, k.data_ptr<float>() + b * kvd, static_cast<std::size_t>(kvd) * sizeof(float));
      std::memcpy(vp + sm[b] * kvd, v.data_ptr<float>() + b * kvd, static_cast<std::size_t>(kvd) * sizeof(float));
    }
    auto attn = at::empty({B, qd}, f32);
    if (!dec_rows.empty())
      cpu::decode_attention(q.data_ptr<float>(), kp, vp, nh, nkv, hd, static_cast<std::int64_t>(dec_rows.size()),
                            dec_rows.data(), slots.data(), lens.data(), attn.data_ptr<float>());
    if (cpu::causal_attention_available(hd)) {
      // Our blocked causal kernel, every chunk of the step in one call; a chunk after cached
      // context reads that context gathered from the pool (its own keys included: they were
      // written above).
      std::vector<cpu::AttentionChunk> chunks;
      std::vector<at::Tensor> gathered;
      for (std::size_t i : chunk_segs) {
        const auto& seg = batch.segs[i];
        cpu::AttentionChunk c{q.data_ptr<float>() + seg.begin * qd, k.data_ptr<float>() + seg.begin * kvd,
                              v.data_ptr<float>() + seg.begin * kvd, attn.data_ptr<float>() + seg.begin * qd, seg.len,
                              seg.past};
        if (seg.past > 0) {
          const auto& ctx = meta.context_slots[i];
          c.k = gathered.emplace_back(kv.k[l].index_select(0, ctx).contiguous()).data_ptr<float>();
          c.v = gathered.emplace_back(kv.v[l].index_select(0, ctx).contiguous()).data_ptr<float>();
        }
        chunks.push_back(c);
      }
      if (!chunks.empty()) cpu::causal_attention(chunks, qd, kvd, qd, nh, nkv, hd);
    } else {
      // libtorch's fused attention (no AVX2, or a head size our kernel does not take).
      for (std::size_t i : chunk_segs) {
        const auto& seg = batch.segs[i];
        auto qs = q.narrow(0, seg.begin, seg.len).view({seg.len, nh, hd});
        at::Tensor out;
        if (seg.past == 0) {
          out = segment_attention(qs, k.narrow(0, seg.begin, seg.len).view({seg.len, nkv, hd}),
                                  v.narrow(0, seg.begin, seg.len).view({seg.len, nkv, hd}), 0);
        } else {
          const auto& ctx = meta.context_slots[i];
          out = segment_attention(qs, kv.k[l].index_select(0, ctx), kv.v[l].index_select(0, ctx), seg.past);
        }
        attn.narrow(0, seg.begin, seg.len).copy_(out);
      }
    }
    auto o = at::empty({B, d}, f32);
    project(attn, {{&Ly.o_w, nullptr, &o}}, lp, li, {{&o, LoraModule::kO}});
    add_into(h, o);

    cpu::rms_norm(h.data_ptr<float>(), Ly.post_norm.data_ptr<float>(), eps, B, d, x.data_ptr<float>());
    auto gate = at::empty({B, I}, f32), up = at::empty({B, I}, f32);
    project(x, {{&Ly.gate_w, nullptr, &gate}, {&Ly.up_w, nullptr, &up}}, lp, li,
            {{&gate, LoraModule::kGate}, {&up, LoraModule::kUp}});
    auto act = at::empty({B, I}, f32);
    cpu::silu_mul(gate.data_ptr<float>(), up.data_ptr<float>(), B * I, act.data_ptr<float>());
    auto down = at::empty({B, d}, f32);
    project(act, {{&Ly.down_w, nullptr, &down}}, lp, li, {{&down, LoraModule::kDown}});
    add_into(h, down);
  }
  auto out = at::empty({B, d}, f32);
  cpu::rms_norm(h.data_ptr<float>(), final_norm_.data_ptr<float>(), eps, B, d, out.data_ptr<float>());
  return out;
}

at::Tensor DecoderModel::logits(const at::Tensor& hidden) const {
  const auto& w = lm_head_weight();
  if (cpu_fast_paths() && fp32_cpu_contiguous(w) && hidden.dim() == 2 && hidden.device().is_cpu() &&
      hidden.scalar_type() == at::kFloat && hidden.size(0) <= kKernelMaxRows &&
      hidden.size(1) == w.size(1) && !(c10::GradMode::is_enabled() && hidden.requires_grad())) {
    auto x = hidden.contiguous();
    auto y = reusable_logits(x.size(0), w.size(0));
    linear_into(x, {{&w, nullptr, &y}});
    return y;
  }
  return at::linear(hidden, w).to(hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

}  // namespace lorasync::model
