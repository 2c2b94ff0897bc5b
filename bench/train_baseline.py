#!/usr/bin/env python3
"""The PyTorch baseline of `lorasync bench train --baseline pytorch` (docs/benchmarks.md).

The same training step as lorasync's, written the way an ML engineer would in plain PyTorch:
the Qwen2 decoder (RMSNorm, rotate-half RoPE, GQA with q/k/v bias, SwiGLU, tied or separate LM
head) with rank-r LoRA on every linear layer, run over packed rows (several samples per row,
positions restarting per sample, causal attention that never crosses a sample) through
`F.scaled_dot_product_attention`, the LM head only at the completion positions in chunks
(log_softmax + gather, entropy without gradient), the GRPO token loss with `step_start` and a TIS
cap of 2, and one backward per row. Clipping and AdamW are left out of the timing, as in lorasync's
`fwd_bwd_step_s`.

Inputs (written by `bench train`): --model DIR (config.json + safetensors, Hugging Face names) and
--rows FILE (JSON: {"rows": [[{"prompt": [...], "completion": [...]}, ...], ...], "denominator": D}).
Prints one JSON line: tokens per step, the mean fwd+bwd seconds over --steps after one warm-up,
trained tokens/s and the process's peak RSS.
"""
import argparse
import json
import math
import os
import resource
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def load_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
        else ["model.safetensors"]
    w = {}
    for f in files:
        w.update(load_file(os.path.join(model_dir, f)))
    return {k: v.float() for k, v in w.items()}


MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Model:
    def __init__(self, cfg, w, rank, alpha, seed):
        self.cfg = cfg
        self.w = w
        self.n_layers = cfg["num_hidden_layers"]
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.embed = w["model.embed_tokens.weight"]
        self.head = w.get("lm_head.weight", self.embed)
        self.inv_freq = 1.0 / (cfg.get("rope_theta", 10000.0) **
                               (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        self.scaling = alpha / rank
        g = torch.Generator().manual_seed(seed)
        self.lora = {}
        for l in range(self.n_layers):
            for m in MODULES:
                wt = self.lin(l, m)
                out_f, in_f = wt.shape
                bound = 1.0 / math.sqrt(in_f)
                a = (torch.rand(rank, in_f, generator=g) * 2 - 1) * bound
                self.lora[(l, m)] = (a.requires_grad_(), torch.zeros(out_f, rank, requires_grad=True))

    def lin(self, l, m):
        part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        return self.w[f"model.layers.{l}.{part}.{m}.weight"]

    def linear(self, x, l, m):
        part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        y = F.linear(x, self.lin(l, m), self.w.get(f"model.layers.{l}.{part}.{m}.bias"))
        a, b = self.lora[(l, m)]
        return y + F.linear(F.linear(x, a), b) * self.scaling

    def rms_norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rot * sin

    def forward(self, tokens, positions, segments):
        T = tokens.shape[0]
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        h = F.embedding(tokens, self.embed)
        g = self.nh // self.nkv
        for l in range(self.n_layers):
            x = self.rms_norm(h, self.w[f"model.layers.{l}.input_layernorm.weight"])
            q = self.rope(self.linear(x, l, "q_proj").view(T, self.nh, self.hd), cos, sin)
            k = self.rope(self.linear(x, l, "k_proj").view(T, self.nkv, self.hd), cos, sin)
            v = self.linear(x, l, "v_proj").view(T, self.nkv, self.hd)
            outs = []
            for b, n in segments:
                qs = q[b:b + n].transpose(0, 1)
                ks = k[b:b + n].transpose(0, 1).repeat_interleave(g, 0)
                vs = v[b:b + n].transpose(0, 1).repeat_interleave(g, 0)
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
            att = torch.cat(outs, 0).reshape(T, self.nh * self.hd)
            h = h + self.linear(att, l, "o_proj")
            x = self.rms_norm(h, self.w[f"model.layers.{l}.post_attention_layernorm.weight"])
            act = F.silu(self.linear(x, l, "gate_proj")) * self.linear(x, l, "up_proj")
            h = h + self.linear(act, l, "down_proj")
        return self.rms_norm(h, self.w["model.norm.weight"])


def prepare(row):
    tokens, positions, segments, pred, targets = [], [], [], [], []
    for s in row:
        b = len(tokens)
        seq = s["prompt"] + s["completion"]
        tokens += seq
        positions += list(range(len(seq)))
        segments.append((b, len(seq)))
        P = len(s["prompt"])
        pred += [b + P - 1 + t for t in range(len(s["completion"]))]
        targets += s["completion"]
    return (torch.tensor(tokens), torch.tensor(positions), segments, torch.tensor(pred),
            torch.tensor(targets))


def row_logprobs(model, row, chunk):
    """Completion logprobs (with gradient) and entropies of one prepared row."""
    tokens, positions, segments, pred, targets = row
    hidden = model.forward(tokens, positions, segments)
    lps, ents = [], []
    for s in range(0, pred.shape[0], chunk):
        z = F.linear(hidden[pred[s:s + chunk]], model.head)
        logp = torch.log_softmax(z, -1)
        lps.append(logp.gather(1, targets[s:s + chunk, None]).squeeze(1))
        with torch.no_grad():
            ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps), torch.cat(ents)


def load_adapter(model, adapter_dir):
    """Replaces the LoRA factors by a PEFT adapter's (adapter_model.safetensors, all-linear)."""
    t = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    for (l, m), (a, b) in model.lora.items():
        part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"base_model.model.model.layers.{l}.{part}.{m}.lora_"
        with torch.no_grad():
            a.copy_(t[key + "A.weight"])
            b.copy_(t[key + "B.weight"])


def step(model, rows, chunk, denominator):
    for row in rows:
        lp, _ = row_logprobs(model, row, chunk)
        with torch.no_grad():
            mu = lp.detach() - 0.01
            adv = torch.full_like(lp, 0.5)
            w = torch.clamp(torch.exp(lp.detach() - mu), max=2.0)
        ratio = torch.exp(lp - lp.detach())
        loss = -w * torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
        (loss.sum() / denominator).backward()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", required=True)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--logits-chunk", type=int, default=512)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    model = Model(cfg, load_weights(args.model), args.rank, args.alpha, seed=1)
    spec = json.load(open(args.rows))
    rows = [prepare(r) for r in spec["rows"]]
    tokens = sum(t[0].shape[0] for t in rows)
    params = [p for ab in model.lora.values() for p in ab]
    times = []
    for i in range(args.steps + 1):  # step 0 warms up
        t0 = time.perf_counter()
        step(model, rows, args.logits_chunk, spec["denominator"])
        times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    fb = sum(times[1:]) / max(1, len(times) - 1)
    print(json.dumps({"tokens_per_step": tokens, "fwd_bwd_step_s": fb, "trained_tokens_per_s": tokens / fb,
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
