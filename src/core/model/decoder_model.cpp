#include "core/model/decoder_model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <utility>

#include "core/io/checkpoint_dir.h"
#include "core/model/autograd_ops.h"
#include "core/model/device_kernels.h"
#include "util/error.h"
#include "util/log.h"

namespace lorasync::model {

namespace {

c10::ScalarType to_scalar(io::DType d, const std::string& name) {
  switch (d) {
    case io::DType::kF64: return c10::kDouble;
    case io::DType::kF32: return c10::kFloat;
    case io::DType::kF16: return c10::kHalf;
    case io::DType::kBF16: return c10::kBFloat16;
    case io::DType::kI64: return c10::kLong;
    case io::DType::kI32: return c10::kInt;
    case io::DType::kI16: return c10::kShort;
    case io::DType::kI8: return c10::kChar;
    case io::DType::kU8: return c10::kByte;
    case io::DType::kBool: return c10::kBool;
  }
  throw_invalid("tensor '{}': unknown dtype", name);
}

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

Batch make_batch(const std::vector<std::vector<std::int64_t>>& seqs,
                 const std::vector<std::int64_t>& pasts, c10::Device device) {
  Batch b;
  std::vector<std::int64_t> toks, pos;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    std::int64_t past = pasts.empty() ? 0 : pasts.at(i);
    Segment s{static_cast<std::int64_t>(toks.size()), static_cast<std::int64_t>(seqs[i].size()), past};
    for (std::size_t j = 0; j < seqs[i].size(); ++j) {
      toks.push_back(seqs[i][j]);
      pos.push_back(past + static_cast<std::int64_t>(j));
    }
    b.segs.push_back(s);
  }
  auto opts = at::TensorOptions().dtype(at::kLong);
  b.tokens = at::tensor(toks, opts).to(device);
  b.positions = at::tensor(pos, opts).to(device);
  return b;
}

// Accumulation dtype: fp32 for fp32/bf16/fp16 (as transformers), fp64 for fp64 models (checks).
inline at::ScalarType acc_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto x32 = x.to(acc_type(x));
  auto var = x32.pow(2).mean(-1, /*keepdim=*/true);
  x32 = x32 * at::rsqrt(var + eps);
  return weight * x32.to(x.scalar_type());
}

namespace {
// Set while a checkpointed layer runs (forward and recompute): both must take the same RMSNorm
// path, so the backward pass differentiates exactly the values the forward pass produced.
thread_local bool t_reference_norm = false;
struct ReferenceNormGuard {
  bool prev = std::exchange(t_reference_norm, true);
  ~ReferenceNormGuard() { t_reference_norm = prev; }
};
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // Our fused kernel on CUDA when no gradient flows through the call (it has no backward).
  if (!t_reference_norm && x.is_cuda() && have_cuda_kernels() && x.scalar_type() == weight.scalar_type() &&
      x.scalar_type() != at::kDouble &&
      !(c10::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())))
    return cuda::rms_norm(x, weight, eps);
  return rms_norm_reference(x, weight, eps);
}

at::Tensor rope_inv_freq(std::int64_t head_dim, double theta, c10::Device device) {
  // 1 / theta^(arange(0, d, 2) / d), in fp32, as transformers computes it.
  auto idx = at::arange(0, head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat);
  auto expo = idx / static_cast<float>(head_dim);
  auto base = at::full({}, theta, at::TensorOptions().dtype(at::kFloat));
  return (1.0 / at::pow(base, expo)).to(device);
}

at::Tensor rope_inv_freq(const ModelConfig& cfg, c10::Device device) {
  auto inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, at::kCPU);
  if (cfg.rope_llama3) {
    // Wavelengths longer than original / low_freq_factor are divided by `factor`, shorter than
    // original / high_freq_factor kept, and those between interpolated (fp32 throughout).
    const auto& r = *cfg.rope_llama3;
    const double old_len = static_cast<double>(r.original_max_position_embeddings);
    const double low_wavelen = old_len / r.low_freq_factor;
    const double high_wavelen = old_len / r.high_freq_factor;
    auto wavelen = 2 * M_PI / inv;
    auto scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
    auto smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
    auto smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
    auto medium = at::logical_not(wavelen < high_wavelen) & at::logical_not(wavelen > low_wavelen);
    inv = at::where(medium, smoothed, scaled).to(at::kFloat);
  }
  return inv.to(device);
}

std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& positions, const at::Tensor& inv_freq) {
  auto freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, hd/2]
  auto emb = at::cat({freqs, freqs}, -1);                                         // [T, hd]
  return {emb.cos(), emb.sin()};
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // x [T, H, hd]; cos/sin [T, hd] -> broadcast over heads.
  const auto half = x.size(-1) / 2;
  auto c = cos.to(x.scalar_type()).unsqueeze(1);
  auto s = sin.to(x.scalar_type()).unsqueeze(1);
  auto x1 = x.narrow(-1, 0, half);
  auto x2 = x.narrow(-1, half, half);
  auto rot = at::cat({-x2, x1}, -1);
  return x * c + rot * s;
}

at::Tensor segment_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             std::int64_t past) {
  const auto L = q.size(0), nh = q.size(1), hd = q.size(2);
  const auto S = k.size(0), nkv = k.size(1);
  const auto g = nh / nkv;
  auto qh = q.view({L, nkv, g, hd}).permute({1, 2, 0, 3});   // [nkv, g, L, hd]
  auto kh = k.permute({1, 0, 2}).unsqueeze(1);                // [nkv, 1, S, hd]
  auto vh = v.permute({1, 0, 2}).unsqueeze(1);                // [nkv, 1, S, hd]
  auto scores = at::matmul(qh, kh.transpose(-1, -2)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  if (L > 1 || past + L < S) {
    // Key j is visible to query i iff j <= past + i.
    auto mask = at::ones({L, S}, at::TensorOptions().dtype(at::kBool).device(q.device()))
                    .triu(past + 1);  // true above the allowed diagonal
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  auto probs = at::softmax(scores, -1, acc_type(q)).to(q.scalar_type());
  auto out = at::matmul(probs, vh);                           // [nkv, g, L, hd]
  return out.permute({2, 0, 1, 3}).reshape({L, nh * hd});
}

at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             std::int64_t past) {
  // libtorch's fused attention: flash attention on CUDA (fp16/bf16) and its blocked CPU kernel,
  // neither of which keeps the [L, S] scores for the backward pass (only a logsumexp per row).
  const auto L = q.size(0), nh = q.size(1), hd = q.size(2);
  const auto S = k.size(0), nkv = k.size(1);
  const auto g = nh / nkv;
  auto qh = q.transpose(0, 1).unsqueeze(0);  // [1, nh, L, hd]
  auto kh = k.transpose(0, 1).unsqueeze(0);  // [1, nkv, S, hd]
  auto vh = v.transpose(0, 1).unsqueeze(0);
  if (g > 1) {
    // KV head j serves query heads [j*g, (j+1)*g): expanded here, since the fused CPU kernel
    // takes no GQA (enable_gqa falls back to the unfused path there).
    kh = kh.unsqueeze(2).expand({1, nkv, g, S, hd}).reshape({1, nh, S, hd});
    vh = vh.unsqueeze(2).expand({1, nkv, g, S, hd}).reshape({1, nh, S, hd});
  }
  at::Tensor out;
  if (past == 0 && L == S) {
    out = at::scaled_dot_product_attention(qh, kh, vh, {}, 0.0, /*is_causal=*/true);
  } else if (L == 1) {
    out = at::scaled_dot_product_attention(qh, kh, vh);  // the last query sees every key
  } else {
    // Key j is visible to query i iff j <= past + i (true = attend).
    auto mask = at::ones({L, S}, at::TensorOptions().dtype(at::kBool).device(q.device())).tril(past);
    out = at::scaled_dot_product_attention(qh, kh, vh, mask);
  }
  return out.squeeze(0).transpose(0, 1).reshape({L, nh * hd});  // [L, nh*hd]
}

at::Tensor paged_decode_attention_reference(const at::Tensor& q, const at::Tensor& k_pool,
                                            const at::Tensor& v_pool, const at::Tensor& slots,
                                            const at::Tensor& bias) {
  const auto B = slots.size(0), Lmax = slots.size(1), nh = q.size(1), hd = q.size(2);
  const auto nkv = k_pool.size(1), g = nh / nkv;
  auto flat = slots.reshape({-1});
  auto K = k_pool.index_select(0, flat).view({B, Lmax, nkv, hd}).permute({0, 2, 1, 3}).unsqueeze(2);
  auto V = v_pool.index_select(0, flat).view({B, Lmax, nkv, hd}).permute({0, 2, 1, 3}).unsqueeze(2);
  auto qh = q.reshape({B, nkv, g, 1, hd});
  auto scores = at::matmul(qh, K.transpose(-1, -2)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  scores = scores + bias.view({B, 1, 1, 1, Lmax}).to(scores.scalar_type());
  auto probs = at::softmax(scores, -1, acc_type(q)).to(q.scalar_type());
  return at::matmul(probs, V).reshape({B, nh * hd});  // [B, nkv, g, 1, hd] -> [B, nh*hd]
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& slots, const at::Tensor& bias, const at::Tensor& lens) {
  if (q.is_cuda() && lens.defined() && have_cuda_kernels() &&
      !(c10::GradMode::is_enabled() && q.requires_grad()) &&
      cuda::paged_decode_attention_fits(q, k_pool))
    return cuda::paged_decode_attention(q, k_pool, v_pool, slots, lens);
  return paged_decode_attention_reference(q, k_pool, v_pool, slots, bias);
}

namespace {
std::atomic<bool> g_varlen_attention{true};
}

bool set_varlen_attention(bool on) { return g_varlen_attention.exchange(on); }

bool varlen_attention_applies(const at::Tensor& q) {
  const auto dt = q.scalar_type();
  const auto hd = q.size(-1);
  return g_varlen_attention.load() && q.is_cuda() && (dt == at::kBFloat16 || dt == at::kHalf) && hd % 8 == 0 &&
         hd <= 256;
}

at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<Segment>& segs) {
  const auto T = q.size(0), nh = q.size(1), hd = q.size(2);
  if (varlen_attention_applies(q)) {
    // One flash-attention call over every segment, delimited by cumulative lengths; its
    // backward is libtorch's (_flash_attention_backward), keeping one logsumexp per query.
    std::vector<std::int32_t> cu{0};
    std::int64_t max_len = 0;
    for (const auto& s : segs) {
      cu.push_back(cu.back() + static_cast<std::int32_t>(s.len));
      max_len = std::max(max_len, s.len);
    }
    auto cum = at::tensor(cu, at::TensorOptions().dtype(at::kInt)).to(q.device());
    try {
      auto r = at::_flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), cum, cum, max_len,
                                            max_len, 0.0, /*is_causal=*/true, /*return_debug_mask=*/false);
      return std::get<0>(r).reshape({T, nh * hd});
    } catch (const c10::Error& e) {
      // A GPU older than sm80, or a libtorch built without flash attention: per segment from now on.
      if (g_varlen_attention.exchange(false))
        LS_LOG_WARN("model", "varlen flash attention unavailable ({}); packed rows attend per segment",
                    e.what_without_backtrace());
    }
  }
  std::vector<at::Tensor> parts;
  parts.reserve(segs.size());
  for (const auto& s : segs)
    parts.push_back(segment_attention(q.narrow(0, s.begin, s.len), k.narrow(0, s.begin, s.len),
                                      v.narrow(0, s.begin, s.len), 0));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

DecoderModel::DecoderModel(ModelConfig cfg, c10::ScalarType dtype, c10::Device device)
    : cfg_(std::move(cfg)), dtype_(dtype), device_(device) {
  inv_freq_ = rope_inv_freq(cfg_, device_);
}

std::unique_ptr<DecoderModel> DecoderModel::from_named(const ModelConfig& cfg, const NamedTensors& named,
                                                   c10::ScalarType dtype, c10::Device device,
                                                   const std::string& label) {
  std::unique_ptr<DecoderModel> m(new DecoderModel(cfg, dtype, device));
  std::unordered_map<std::string, const at::Tensor*> by_name;
  for (const auto& [n, t] : named) by_name[n] = &t;
  std::size_t used = 0;
  auto take = [&](const std::string& name, std::vector<std::int64_t> shape) -> at::Tensor {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw_invalid("{}: weight '{}' is missing", label, name);
    const at::Tensor& t = *it->second;
    if (t.sizes() != at::IntArrayRef(shape))
      throw_invalid("{}: weight '{}' has shape {}, the config needs {}", label, name,
                    shape_str(t.sizes()), shape_str(shape));
    ++used;
    // Always a private copy in the compute dtype: weights never alias a file mapping.
    if (device.is_cpu()) {
      auto w = empty_cpu_huge_pages(t.sizes(), dtype);
      w.copy_(t);
      return w;
    }
    return t.to(at::TensorOptions().dtype(dtype).device(device), /*non_blocking=*/false,
                /*copy=*/true);
  };
  const auto d = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
  const auto qd = cfg.q_dim(), kvd = cfg.kv_dim();
  m->embed_ = take("model.embed_tokens.weight", {V, d});
  m->final_norm_ = take("model.norm.weight", {d});
  if (!cfg.tie_word_embeddings) {
    m->lm_head_ = take("lm_head.weight", {V, d});
  } else if (by_name.count("lm_head.weight")) {
    ++used;  // tied: a stored copy is ignored, as transformers does
  }
  for (std::int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer L;
    L.input_norm = take(p + "input_layernorm.weight", {d});
    L.q_w = take(p + "self_attn.q_proj.weight", {qd, d});
    L.k_w = take(p + "self_attn.k_proj.weight", {kvd, d});
    L.v_w = take(p + "self_attn.v_proj.weight", {kvd, d});
    if (cfg.attention_bias) {
      L.q_b = take(p + "self_attn.q_proj.bias", {qd});
      L.k_b = take(p + "self_attn.k_proj.bias", {kvd});
      L.v_b = take(p + "self_attn.v_proj.bias", {kvd});
    }
    if (cfg.qk_norm) {
      L.q_norm = take(p + "self_attn.q_norm.weight", {cfg.head_dim});
      L.k_norm = take(p + "self_attn.k_norm.weight", {cfg.head_dim});
    }
    L.o_w = take(p + "self_attn.o_proj.weight", {d, qd});
    L.post_norm = take(p + "post_attention_layernorm.weight", {d});
    L.gate_w = take(p + "mlp.gate_proj.weight", {I, d});
    L.up_w = take(p + "mlp.up_proj.weight", {I, d});
    L.down_w = take(p + "mlp.down_proj.weight", {d, I});
    m->layers_.push_back(std::move(L));
  }
  if (used != named.size())
    LS_LOG_WARN("model", "{}: {} of {} weights are not part of the {} architecture and were ignored",
                label, named.size() - used, named.size(), family_name(cfg.family));
  return m;
}

std::unique_ptr<DecoderModel> DecoderModel::load(const std::filesystem::path& dir, c10::ScalarType dtype,
                                             c10::Device device) {
  auto cfg = ModelConfig::load(dir);
  auto ws = io::open_weights(dir);
  NamedTensors named;
  for (const auto& name : ws.names()) {
    const auto& v = ws.get(name);
    auto t = at::from_blob(const_cast<std::uint8_t*>(v.data), v.shape,
                           at::TensorOptions().dtype(to_scalar(v.dtype, name)));
    named.emplace_back(name, t);
  }
  return from_named(cfg, named, dtype, device, dir.string());
}

at::Tensor DecoderModel::attention(std::int64_t l, const at::Tensor& x, const Batch& batch,
                                 const at::Tensor& cos, const at::Tensor& sin,
                                 const LoraBatch* lora, KvPool* kv, const AttnMeta* meta) const {
  const Layer& L = layers_[static_cast<std::size_t>(l)];
  const auto T = x.size(0), nh = cfg_.num_attention_heads, nkv = cfg_.num_key_value_heads,
             hd = cfg_.head_dim;
  auto proj = [&](const at::Tensor& w, const at::Tensor& b, LoraModule m) {
    auto y = at::linear(x, w, b);
    return lora ? lora->apply(x, std::move(y), l, m) : y;
  };
  auto q = proj(L.q_w, L.q_b, LoraModule::kQ).view({T, nh, hd});
  auto k = proj(L.k_w, L.k_b, LoraModule::kK).view({T, nkv, hd});
  if (cfg_.qk_norm) {  // Qwen3: each head of q and k RMSNormed over head_dim, before RoPE
    q = rms_norm(q.reshape({T * nh, hd}), L.q_norm, cfg_.rms_norm_eps).view({T, nh, hd});
    k = rms_norm(k.reshape({T * nkv, hd}), L.k_norm, cfg_.rms_norm_eps).view({T, nkv, hd});
  }
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  auto v = proj(L.v_w, L.v_b, LoraModule::kV).view({T, nkv, hd});

  at::Tensor out;
  if (kv != nullptr) {
    auto& kp = kv->k[static_cast<std::size_t>(l)];
    auto& vp = kv->v[static_cast<std::size_t>(l)];
    kp.index_copy_(0, meta->slot_mapping, k);
    vp.index_copy_(0, meta->slot_mapping, v);
    if (meta->decode_slots.defined()) {
      // Pure decode: every sequence's one query against its keys in the pool.
      out = paged_decode_attention(q, kp, vp, meta->decode_slots, meta->decode_bias, meta->decode_lens);
    } else {
      std::vector<at::Tensor> parts;
      parts.reserve(batch.segs.size());
      for (std::size_t i = 0; i < batch.segs.size(); ++i) {
        const auto& s = batch.segs[i];
        auto qs = q.narrow(0, s.begin, s.len);
        if (s.past == 0) {
          parts.push_back(segment_attention(qs, k.narrow(0, s.begin, s.len),
                                            v.narrow(0, s.begin, s.len), 0));
        } else {
          const auto& ctx = meta->context_slots.at(i);
          parts.push_back(segment_attention(qs, kp.index_select(0, ctx), vp.index_select(0, ctx), s.past));
        }
      }
      out = parts.size() == 1 ? parts[0] : at::cat(parts, 0);
    }
  } else {
    out = packed_attention(q, k, v, batch.segs);
  }
  auto y = at::linear(out, L.o_w);
  return lora ? lora->apply(out, std::move(y), l, LoraModule::kO) : y;
}

at::Tensor DecoderModel::decoder_layer(std::int64_t l, const at::Tensor& h_in, const Batch& batch,
                                     const at::Tensor& cos, const at::Tensor& sin, const LoraBatch* lora,
                                     KvPool* kv, const AttnMeta* meta) const {
  const Layer& L = layers_[static_cast<std::size_t>(l)];
  auto x = rms_norm(h_in, L.input_norm, cfg_.rms_norm_eps);
  auto h = h_in + attention(l, x, batch, cos, sin, lora, kv, meta);
  x = rms_norm(h, L.post_norm, cfg_.rms_norm_eps);
  auto gate = at::linear(x, L.gate_w);
  auto up = at::linear(x, L.up_w);
  if (lora) {
    gate = lora->apply(x, std::move(gate), l, LoraModule::kGate);
    up = lora->apply(x, std::move(up), l, LoraModule::kUp);
  }
  auto act = at::silu(gate) * up;
  auto down = at::linear(act, L.down_w);
  if (lora) down = lora->apply(act, std::move(down), l, LoraModule::kDown);
  return h + down;
}

at::Tensor DecoderModel::forward(const Batch& batch, const LoraBatch* lora, KvPool* kv,
                               const AttnMeta* meta, bool checkpoint_layers) const {
  LS_CHECK((kv == nullptr) == (meta == nullptr), "kv and meta go together");
  if (checkpoint_layers && kv != nullptr) throw_invalid("activation checkpointing applies to forwards without a KV cache");
  if (lora != nullptr && lora->empty()) lora = nullptr;
  if (cpu_decode_applies(batch, kv, meta)) return forward_cpu_decode(batch, lora, *kv, *meta);
  auto [cos, sin] = rope_cos_sin(batch.positions, inv_freq_);
  auto h = at::embedding(embed_, batch.tokens);  // [T, d]
  for (std::int64_t l = 0; l < cfg_.num_hidden_layers; ++l) {
    if (!checkpoint_layers) {
      h = decoder_layer(l, h, batch, cos, sin, lora, kv, meta);
      continue;
    }
    // The body owns copies of what it reads: it runs again in the backward pass.
    auto lb = std::make_shared<const LoraBatch>(lora ? *lora : LoraBatch());
    auto body = [this, l, batch, cos = cos, sin = sin, lb](const at::Tensor& x) {
      ReferenceNormGuard same_path;
      return decoder_layer(l, x, batch, cos, sin, lb->empty() ? nullptr : lb.get(), nullptr, nullptr);
    };
    h = checkpoint(std::move(body), h, lb->parameters(l));
  }
  return rms_norm(h, final_norm_, cfg_.rms_norm_eps);
}

at::Tensor& DecoderModel::module_weight(std::int64_t layer, LoraModule m) {
  Layer& L = layers_.at(static_cast<std::size_t>(layer));
  switch (m) {
    case LoraModule::kQ: return L.q_w;
    case LoraModule::kK: return L.k_w;
    case LoraModule::kV: return L.v_w;
    case LoraModule::kO: return L.o_w;
    case LoraModule::kGate: return L.gate_w;
    case LoraModule::kUp: return L.up_w;
    case LoraModule::kDown: return L.down_w;
  }
  LS_CHECK(false, "bad module");
  return L.q_w;
}

void DecoderModel::merge_lora(const LoraAdapter& adapter, double sign) {
  const double s = adapter.config().scaling() * sign;
  for (std::int64_t l = 0; l < adapter.n_layers(); ++l)
    for (int mi = 0; mi < kNumLoraModules; ++mi) {
      auto m = static_cast<LoraModule>(mi);
      if (!adapter.config().targets_module(m)) continue;
      auto delta = at::matmul(adapter.B(l, m).to(at::kFloat), adapter.A(l, m).to(at::kFloat)) * s;
      at::Tensor& w = module_weight(l, m);
      w.copy_((w.to(at::kFloat) + delta.to(w.device())).to(w.scalar_type()));
    }
}

NamedTensors DecoderModel::named_weights() const {
  NamedTensors out;
  out.emplace_back("model.embed_tokens.weight", embed_);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const Layer& L = layers_[i];
    out.emplace_back(p + "input_layernorm.weight", L.input_norm);
    out.emplace_back(p + "self_attn.q_proj.weight", L.q_w);
    if (L.q_b.defined()) out.emplace_back(p + "self_attn.q_proj.bias", L.q_b);
    out.emplace_back(p + "self_attn.k_proj.weight", L.k_w);
    if (L.k_b.defined()) out.emplace_back(p + "self_attn.k_proj.bias", L.k_b);
    out.emplace_back(p + "self_attn.v_proj.weight", L.v_w);
    if (L.v_b.defined()) out.emplace_back(p + "self_attn.v_proj.bias", L.v_b);
    if (L.q_norm.defined()) out.emplace_back(p + "self_attn.q_norm.weight", L.q_norm);
    if (L.k_norm.defined()) out.emplace_back(p + "self_attn.k_norm.weight", L.k_norm);
    out.emplace_back(p + "self_attn.o_proj.weight", L.o_w);
    out.emplace_back(p + "post_attention_layernorm.weight", L.post_norm);
    out.emplace_back(p + "mlp.gate_proj.weight", L.gate_w);
    out.emplace_back(p + "mlp.up_proj.weight", L.up_w);
    out.emplace_back(p + "mlp.down_proj.weight", L.down_w);
  }
  out.emplace_back("model.norm.weight", final_norm_);
  if (!cfg_.tie_word_embeddings) out.emplace_back("lm_head.weight", lm_head_);
  return out;
}

NamedTensors random_weights(const ModelConfig& cfg, std::uint64_t seed, c10::ScalarType dtype,
                            double std) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto normal = [&](std::vector<std::int64_t> shape, double mean, double sd) {
    auto t = at::empty(shape, f32);
    t.normal_(mean, sd, gen);
    return t.to(dtype);
  };
  const auto d = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
  const auto qd = cfg.q_dim(), kvd = cfg.kv_dim();
  NamedTensors out;
  out.emplace_back("model.embed_tokens.weight", normal({V, d}, 0, std));
  for (std::int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    out.emplace_back(p + "input_layernorm.weight", normal({d}, 1.0, 0.1));
    // The draws of a qwen2 model come in the order they always did (same seed, same weights).
    out.emplace_back(p + "self_attn.q_proj.weight", normal({qd, d}, 0, std));
    if (cfg.attention_bias) out.emplace_back(p + "self_attn.q_proj.bias", normal({qd}, 0, std));
    out.emplace_back(p + "self_attn.k_proj.weight", normal({kvd, d}, 0, std));
    if (cfg.attention_bias) out.emplace_back(p + "self_attn.k_proj.bias", normal({kvd}, 0, std));
    out.emplace_back(p + "self_attn.v_proj.weight", normal({kvd, d}, 0, std));
    if (cfg.attention_bias) out.emplace_back(p + "self_attn.v_proj.bias", normal({kvd}, 0, std));
    if (cfg.qk_norm) {
      out.emplace_back(p + "self_attn.q_norm.weight", normal({cfg.head_dim}, 1.0, 0.1));
      out.emplace_back(p + "self_attn.k_norm.weight", normal({cfg.head_dim}, 1.0, 0.1));
    }
    out.emplace_back(p + "self_attn.o_proj.weight", normal({d, qd}, 0, std));
    out.emplace_back(p + "post_attention_layernorm.weight", normal({d}, 1.0, 0.1));
    out.emplace_back(p + "mlp.gate_proj.weight", normal({I, d}, 0, std));
    out.emplace_back(p + "mlp.up_proj.weight", normal({I, d}, 0, std));
    out.emplace_back(p + "mlp.down_proj.weight", normal({d, I}, 0, std));
  }
  out.emplace_back("model.norm.weight", normal({d}, 1.0, 0.1));
  if (!cfg.tie_word_embeddings) out.emplace_back("lm_head.weight", normal({V, d}, 0, std));
  return out;
}

}  // namespace lorasync::model
