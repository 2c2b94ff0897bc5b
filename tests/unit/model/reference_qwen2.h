// An independent, deliberately naive Qwen2 forward in double precision (plain loops over
// std::vector), written from the Hugging Face semantics, to check the libtorch model's logits.
// It shares no code with src/core/model beyond reading the weights.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "core/model/model_config.h"

namespace lorasync::model::testing {

struct Mat {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double at(std::int64_t r, std::int64_t c) const { return v[static_cast<std::size_t>(r * cols + c)]; }
};

inline Mat to_mat(const at::Tensor& t) {
  auto c = t.to(at::kDouble).contiguous().cpu();
  Mat m;
  m.rows = c.dim() == 2 ? c.size(0) : 1;
  m.cols = c.dim() == 2 ? c.size(1) : c.size(0);
  m.v.assign(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  return m;
}

using Vec = std::vector<double>;

inline Vec matvec(const Mat& w, const Vec& x, const Mat* bias = nullptr) {
  Vec y(static_cast<std::size_t>(w.rows), 0.0);
  for (std::int64_t r = 0; r < w.rows; ++r) {
    double s = 0;
    for (std::int64_t c = 0; c < w.cols; ++c) s += w.at(r, c) * x[static_cast<std::size_t>(c)];
    y[static_cast<std::size_t>(r)] = s + (bias ? bias->v[static_cast<std::size_t>(r)] : 0.0);
  }
  return y;
}

inline Vec rmsnorm(const Vec& x, const Mat& w, double eps) {
  double ss = 0;
  for (double a : x) ss += a * a;
  double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  Vec y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = w.v[i] * x[i] * inv;
  return y;
}

// Rotate-half RoPE on one head vector at position p.
inline void rope(double* h, std::int64_t hd, std::int64_t p, double theta) {
  const std::int64_t half = hd / 2;
  std::vector<double> out(static_cast<std::size_t>(hd));
  for (std::int64_t i = 0; i < half; ++i) {
    double inv = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(hd));
    double a = static_cast<double>(p) * inv;
    double c = std::cos(a), s = std::sin(a);
    double x1 = h[i], x2 = h[i + half];
    out[static_cast<std::size_t>(i)] = x1 * c - x2 * s;
    out[static_cast<std::size_t>(i + half)] = x2 * c + x1 * s;
  }
  for (std::int64_t i = 0; i < hd; ++i) h[i] = out[static_cast<std::size_t>(i)];
}

// Logits [T][V] of one sequence of token ids (positions 0..T-1), causal attention.
inline std::vector<Vec> reference_logits(const ModelConfig& c,
                                         const std::map<std::string, at::Tensor>& w,
                                         const std::vector<std::int64_t>& ids) {
  auto M = [&](const std::string& n) { return to_mat(w.at(n)); };
  const auto T = static_cast<std::int64_t>(ids.size());
  const auto d = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads,
             hd = c.head_dim, g = nh / nkv;
  Mat emb = M("model.embed_tokens.weight");
  std::vector<Vec> h(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t)
    h[static_cast<std::size_t>(t)] = Vec(emb.v.begin() + ids[static_cast<std::size_t>(t)] * d,
                                         emb.v.begin() + (ids[static_cast<std::size_t>(t)] + 1) * d);
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Mat in_n = M(p + "input_layernorm.weight"), post_n = M(p + "post_attention_layernorm.weight");
    Mat qw = M(p + "self_attn.q_proj.weight"), qb = M(p + "self_attn.q_proj.bias");
    Mat kw = M(p + "self_attn.k_proj.weight"), kb = M(p + "self_attn.k_proj.bias");
    Mat vw = M(p + "self_attn.v_proj.weight"), vb = M(p + "self_attn.v_proj.bias");
    Mat ow = M(p + "self_attn.o_proj.weight");
    Mat gw = M(p + "mlp.gate_proj.weight"), uw = M(p + "mlp.up_proj.weight"),
        dw = M(p + "mlp.down_proj.weight");
    std::vector<Vec> q(static_cast<std::size_t>(T)), k(static_cast<std::size_t>(T)), v(static_cast<std::size_t>(T));
    for (std::int64_t t = 0; t < T; ++t) {
      Vec x = rmsnorm(h[static_cast<std::size_t>(t)], in_n, c.rms_norm_eps);
      q[static_cast<std::size_t>(t)] = matvec(qw, x, &qb);
      k[static_cast<std::size_t>(t)] = matvec(kw, x, &kb);
      v[static_cast<std::size_t>(t)] = matvec(vw, x, &vb);
      for (std::int64_t j = 0; j < nh; ++j) rope(q[static_cast<std::size_t>(t)].data() + j * hd, hd, t, c.rope_theta);
      for (std::int64_t j = 0; j < nkv; ++j) rope(k[static_cast<std::size_t>(t)].data() + j * hd, hd, t, c.rope_theta);
    }
    for (std::int64_t t = 0; t < T; ++t) {
      Vec attn(static_cast<std::size_t>(nh * hd), 0.0);
      for (std::int64_t j = 0; j < nh; ++j) {
        const std::int64_t kvh = j / g;  // KV head serving query head j
        std::vector<double> sc(static_cast<std::size_t>(t + 1));
        double mx = -1e300;
        for (std::int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (std::int64_t e = 0; e < hd; ++e)
            dot += q[static_cast<std::size_t>(t)][static_cast<std::size_t>(j * hd + e)] *
                   k[static_cast<std::size_t>(s)][static_cast<std::size_t>(kvh * hd + e)];
          sc[static_cast<std::size_t>(s)] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, sc[static_cast<std::size_t>(s)]);
        }
        double z = 0;
        for (auto& a : sc) z += (a = std::exp(a - mx));
        for (std::int64_t s = 0; s <= t; ++s)
          for (std::int64_t e = 0; e < hd; ++e)
            attn[static_cast<std::size_t>(j * hd + e)] +=
                sc[static_cast<std::size_t>(s)] / z * v[static_cast<std::size_t>(s)][static_cast<std::size_t>(kvh * hd + e)];
      }
      Vec o = matvec(ow, attn);
      for (std::int64_t i = 0; i < d; ++i) h[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)] += o[static_cast<std::size_t>(i)];
      Vec x = rmsnorm(h[static_cast<std::size_t>(t)], post_n, c.rms_norm_eps);
      Vec ga = matvec(gw, x), up = matvec(uw, x);
      for (std::size_t i = 0; i < ga.size(); ++i) ga[i] = ga[i] / (1.0 + std::exp(-ga[i])) * up[i];
      Vec dn = matvec(dw, ga);
      for (std::int64_t i = 0; i < d; ++i) h[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)] += dn[static_cast<std::size_t>(i)];
    }
  }
  Mat fn = M("model.norm.weight");
  Mat head = c.tie_word_embeddings ? emb : M("lm_head.weight");
  std::vector<Vec> out;
  for (std::int64_t t = 0; t < T; ++t) out.push_back(matvec(head, rmsnorm(h[static_cast<std::size_t>(t)], fn, c.rms_norm_eps)));
  return out;
}

}  // namespace lorasync::model::testing
