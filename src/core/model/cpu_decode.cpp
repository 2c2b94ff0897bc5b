// The decode step on our CPU kernels (qwen2_model.h, set_cpu_fast_paths): the same layer maths as
// Qwen2Model::forward, with the small per-token steps fused into single loops, q/k/v and gate/up
// each computed in one pass over their weights, and attention reading the paged KV cache in place.
// LoRA deltas go through LoraBatch::apply, as on the libtorch path.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <atomic>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "core/model/cpu_kernels.h"
#include "core/model/qwen2_model.h"
#include "util/error.h"

namespace lorasync::model {

namespace {

std::atomic<bool> g_fast{true};

bool fp32_cpu_contiguous(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

// Up to this many rows our kernels stream each weight once (1.1-1.4x the BLAS product at 8-32
// rows on the small preset); above, BLAS's packed GEMM wins.
constexpr std::int64_t kKernelMaxRows = 32;
// Up to this many rows the BLAS product is taken as (w x^T)^T: MKL packs the small x^T instead of
// the weight for every call (1.1-1.8x on decode shapes, measured with the wheel's MKL).
constexpr std::int64_t kBlasTransposedMaxRows = 256;

// y [M, N] = x w^T (+ bias) through BLAS, into y.
void blas_linear_into(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  at::Tensor yt;
  if (x.size(0) <= kBlasTransposedMaxRows) {
    if (bias != nullptr) {
      auto b = at::from_blob(const_cast<float*>(bias), {w.size(0), 1}, at::TensorOptions().dtype(at::kFloat));
      yt = at::addmm(b, w, x.t());
    } else {
      yt = at::mm(w, x.t());
    }
    y.copy_(yt.t());
    return;
  }
  if (bias != nullptr) {
    auto b = at::from_blob(const_cast<float*>(bias), {w.size(0)}, at::TensorOptions().dtype(at::kFloat));
    at::addmm_out(y, b, x, w.t());
  } else {
    at::mm_out(y, x, w.t());
  }
}

// y [M, N] = x [M, K] w^T (+ bias) for several w sharing x: our kernel for a few rows, BLAS above.
void linear_into(const at::Tensor& x, std::initializer_list<cpu::LinearOut> parts,
                 std::initializer_list<std::pair<const at::Tensor*, at::Tensor*>> blas) {
  const auto M = x.size(0), K = x.size(1);
  if (M <= kKernelMaxRows) {
    cpu::linear(x.data_ptr<float>(), M, K, K, std::span<const cpu::LinearOut>(parts.begin(), parts.size()));
    return;
  }
  auto p = parts.begin();
  for (const auto& [w, y] : blas) {
    blas_linear_into(x, *w, p->bias, *y);
    ++p;
  }
}

cpu::LinearOut out_of(const at::Tensor& w, const at::Tensor* bias, at::Tensor& y) {
  return {w.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, w.size(0), y.data_ptr<float>(),
          y.size(1)};
}

void add_into(at::Tensor& h, const at::Tensor& y) {
  float* hp = h.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const auto n = h.numel();
  for (std::int64_t i = 0; i < n; ++i) hp[i] += yp[i];
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
  (void)::madvise(reinterpret_cast<void*>(base), span, MADV_HUGEPAGE);  // advice only
  return at::from_blob(reinterpret_cast<void*>(base), shape, [raw, len](void*) { ::munmap(raw, len); }, opts);
#else
  return at::empty(shape, opts);
#endif
}

bool set_cpu_fast_paths(bool on) { return g_fast.exchange(on); }
bool cpu_fast_paths() { return g_fast.load(std::memory_order_relaxed); }

bool Qwen2Model::cpu_decode_applies(const Batch& batch, const KvPool* kv, const AttnMeta* meta) const {
  if (!cpu_fast_paths() || kv == nullptr || meta == nullptr) return false;
  if (!device_.is_cpu() || dtype_ != at::kFloat || c10::GradMode::is_enabled()) return false;
  const auto B = static_cast<std::int64_t>(batch.segs.size());
  if (B == 0 || batch.n_tokens() != B) return false;
  for (const auto& s : batch.segs)
    if (s.len != 1) return false;
  if (!batch.tokens.device().is_cpu() || !batch.positions.device().is_cpu()) return false;
  if (kv->k.size() != layers_.size() || kv->v.size() != layers_.size()) return false;
  for (std::size_t l = 0; l < layers_.size(); ++l)
    if (!fp32_cpu_contiguous(kv->k[l]) || !fp32_cpu_contiguous(kv->v[l])) return false;
  if (meta->decode_slots.defined()) {
    if (meta->decode_slots.dim() != 2 || meta->decode_slots.size(0) != B) return false;
  } else if (static_cast<std::int64_t>(meta->context_slots.size()) != B) {
    return false;
  }
  return true;
}

at::Tensor Qwen2Model::forward_cpu_decode(const Batch& batch, const LoraBatch* lora, KvPool& kv,
                                          const AttnMeta& meta) const {
  const auto B = batch.n_tokens();
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

  // Each sequence's context: its first past + 1 slots, checked against the pool once per step
  // (the kernels read the pool in place).
  std::vector<at::Tensor> keep;
  std::vector<const std::int64_t*> slots(static_cast<std::size_t>(B));
  std::vector<std::int64_t> lens(static_cast<std::size_t>(B));
  at::Tensor ds;
  if (meta.decode_slots.defined()) ds = meta.decode_slots.to(at::kCPU).to(at::kLong).contiguous();
  for (std::int64_t b = 0; b < B; ++b) {
    const auto& seg = batch.segs[static_cast<std::size_t>(b)];
    const std::int64_t L = seg.past + 1;
    const std::int64_t* p = nullptr;
    if (ds.defined()) {
      if (L > ds.size(1)) throw_invalid("decode sequence {} needs {} context slots, the plan has {}", b, L, ds.size(1));
      p = ds.data_ptr<std::int64_t>() + b * ds.size(1);
    } else if (seg.past == 0 && !meta.context_slots[static_cast<std::size_t>(b)].defined()) {
      p = sm + b;  // a one-token prompt: its context is its own new slot (the engine sends none)
    } else {
      auto c = meta.context_slots[static_cast<std::size_t>(b)].to(at::kCPU).to(at::kLong).contiguous();
      if (c.numel() != L) throw_invalid("decode sequence {} has {} context slots for {} positions", b, c.numel(), L);
      p = c.data_ptr<std::int64_t>();
      keep.push_back(std::move(c));
    }
    for (std::int64_t j = 0; j < L; ++j)
      if (p[j] < 0 || p[j] >= n_slots) throw_invalid("decode sequence {}: slot {} outside the pool of {}", b, p[j], n_slots);
    if (p[L - 1] != sm[b]) throw_invalid("decode sequence {}: its new token's slot {} is not its context's last ({})", b, sm[b], p[L - 1]);
    slots[static_cast<std::size_t>(b)] = p;
    lens[static_cast<std::size_t>(b)] = L;
  }

  auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto h = at::empty({B, d}, f32);
  const float* emb = embed_.data_ptr<float>();
  for (std::int64_t b = 0; b < B; ++b) {
    if (tok[b] < 0 || tok[b] >= V) throw_invalid("token id {} outside the vocabulary of {}", tok[b], V);
    std::memcpy(h.data_ptr<float>() + b * d, emb + tok[b] * d, static_cast<std::size_t>(d) * sizeof(float));
  }
  const float* inv_freq = inv_freq_.data_ptr<float>();
  auto x = at::empty({B, d}, f32);
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& Ly = layers_[l];
    const auto li = static_cast<std::int64_t>(l);
    cpu::rms_norm(h.data_ptr<float>(), Ly.input_norm.data_ptr<float>(), eps, B, d, x.data_ptr<float>());
    auto q = at::empty({B, qd}, f32), k = at::empty({B, kvd}, f32), v = at::empty({B, kvd}, f32);
    linear_into(x, {out_of(Ly.q_w, &Ly.q_b, q), out_of(Ly.k_w, &Ly.k_b, k), out_of(Ly.v_w, &Ly.v_b, v)},
                {{&Ly.q_w, &q}, {&Ly.k_w, &k}, {&Ly.v_w, &v}});
    if (lora) {
      q = lora->apply(x, q, li, LoraModule::kQ).contiguous();
      k = lora->apply(x, k, li, LoraModule::kK).contiguous();
      v = lora->apply(x, v, li, LoraModule::kV).contiguous();
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
    cpu::decode_attention(q.data_ptr<float>(), kp, vp, nh, nkv, hd, B, slots.data(), lens.data(),
                          attn.data_ptr<float>());
    auto o = at::empty({B, d}, f32);
    linear_into(attn, {out_of(Ly.o_w, nullptr, o)}, {{&Ly.o_w, &o}});
    if (lora) o = lora->apply(attn, o, li, LoraModule::kO).contiguous();
    add_into(h, o);

    cpu::rms_norm(h.data_ptr<float>(), Ly.post_norm.data_ptr<float>(), eps, B, d, x.data_ptr<float>());
    auto gate = at::empty({B, I}, f32), up = at::empty({B, I}, f32);
    linear_into(x, {out_of(Ly.gate_w, nullptr, gate), out_of(Ly.up_w, nullptr, up)},
                {{&Ly.gate_w, &gate}, {&Ly.up_w, &up}});
    if (lora) {
      gate = lora->apply(x, gate, li, LoraModule::kGate).contiguous();
      up = lora->apply(x, up, li, LoraModule::kUp).contiguous();
    }
    auto act = at::empty({B, I}, f32);
    cpu::silu_mul(gate.data_ptr<float>(), up.data_ptr<float>(), B * I, act.data_ptr<float>());
    auto down = at::empty({B, d}, f32);
    linear_into(act, {out_of(Ly.down_w, nullptr, down)}, {{&Ly.down_w, &down}});
    if (lora) down = lora->apply(act, down, li, LoraModule::kDown).contiguous();
    add_into(h, down);
  }
  auto out = at::empty({B, d}, f32);
  cpu::rms_norm(h.data_ptr<float>(), final_norm_.data_ptr<float>(), eps, B, d, out.data_ptr<float>());
  return out;
}

at::Tensor Qwen2Model::logits(const at::Tensor& hidden) const {
  const auto& w = lm_head_weight();
  if (cpu_fast_paths() && fp32_cpu_contiguous(w) && hidden.dim() == 2 && hidden.device().is_cpu() &&
      hidden.scalar_type() == at::kFloat && hidden.size(0) <= kBlasTransposedMaxRows &&
      hidden.size(1) == w.size(1) && !(c10::GradMode::is_enabled() && hidden.requires_grad())) {
    auto x = hidden.contiguous();
    auto y = at::empty({x.size(0), w.size(0)}, at::TensorOptions().dtype(at::kFloat));
    if (x.size(0) <= kKernelMaxRows) {
      cpu::LinearOut part{w.data_ptr<float>(), nullptr, w.size(0), y.data_ptr<float>(), w.size(0)};
      cpu::linear(x.data_ptr<float>(), x.size(0), x.size(1), x.size(1), std::span<const cpu::LinearOut>(&part, 1));
    } else {
      blas_linear_into(x, w, nullptr, y);
    }
    return y;
  }
  return at::linear(hidden, w).to(hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

}  // namespace lorasync::model
