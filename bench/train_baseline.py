#!/usr/bin/env python3
"""The PyTorch baseline of `lorasync bench train --baseline pytorch` (docs/benchmarks.md).

The same training step as lorasync's, written the way an ML engineer would in plain PyTorch:
the Qwen2 decoder (RMSNorm, rotate-half RoPE, GQA with q/k/v bias, SwiGLU, tied or separate LM
head), or Qwen3's (no biases, q and k RMSNormed per head before RoPE) or Llama 3's (no biases, the
llama3 RoPE scaling), as the model's config.json and weights say, with rank-r LoRA on every linear layer, run over packed rows (several samples per row,
positions restarting per sample, causal attention that never crosses a sample) through
`F.scaled_dot_product_attention` (one call per sample, or with --attention mask one call per row
with a block-diagonal causal mask), the LM head only at the completion positions in chunks
(log_softmax + gather, entropy without gradient), the GRPO token loss with `step_start` and a TIS
cap of 2, and one backward per row; then gradient clipping (norm 1) and AdamW over the LoRA
factors. The frozen weights never require gradients; there is no separate old-logprob pass
(`step_start` takes the old policy from the step's own forward, as lorasync's bench does).

A step = forward + loss + backward over every row, then clip + AdamW + zero_grad; each part is
timed (`fwd_bwd_s`, `opt_s`) with the minor and major page faults the process took during the step
(getrusage before and after).

Inputs (written by `bench train`): --model DIR (config.json + safetensors, Hugging Face names) and
--rows FILE (JSON: {"rows": [[{"prompt": [...], "completion": [...]}, ...], ...], "denominator": D,
"checksum": "16 hex digits"}). The checksum (rows_checksum: FNV-1a over the row count, each row's
sample count, each sample's prompt and completion lengths and token ids) is recomputed here, and a
file whose checksum disagrees is refused; the figure is reported so that `bench train` can check
that both sides trained the same rows.

Without --serve: one warm-up step, then --steps timed steps; prints one JSON line. With --serve
(how `bench train` drives it, alternating with its own steps): prints a JSON line once ready, then
answers each stdin line `steps N` by running N steps and printing their per-step figures as one
JSON line, and `quit` by printing the peak RSS and exiting.
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
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
ATTENTION = ("segments", "mask")
HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def rope_inv_freq(cfg, hd):
    """1 / theta^(2i/hd), with Llama 3's frequency-dependent scaling when the config asks for it."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return inv
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    out = []
    for f, wl in zip(inv.tolist(), wavelen.tolist()):
        if wl < old / hi:  # high frequency: kept
            out.append(f)
        elif wl > old / lo:  # low frequency: divided by the factor
            out.append(f / factor)
        else:  # between: interpolated
            t = (old / wl - lo) / (hi - lo)
            out.append((1 - t) * f / factor + t * f)
    return torch.tensor(out, dtype=torch.float32)


class Model:
    def __init__(self, cfg, w, rank, alpha, seed, attention="segments"):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.cfg = cfg
        self.w = w
        self.attention = attention
        self.n_layers = cfg["num_hidden_layers"]
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.embed = w["model.embed_tokens.weight"]
        self.head = w.get("lm_head.weight", self.embed)
        self.inv_freq = rope_inv_freq(cfg, self.hd)
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

    def parameters(self):
        return [p for ab in self.lora.values() for p in ab]

    def lin(self, l, m):
        part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        return self.w[f"model.layers.{l}.{part}.{m}.weight"]

    def linear(self, x, l, m):
        part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        y = F.linear(x, self.lin(l, m), self.w.get(f"model.layers.{l}.{part}.{m}.bias"))
        a, b = self.lora[(l, m)]
        return y + F.linear(F.linear(x, a), b) * self.scaling

    def rms_norm(self, x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rot * sin

    def sdpa(self, q, k, v, causal, mask=None):
        """q [nh, n, hd], k and v [nkv, n, hd]."""
        if HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  enable_gqa=self.nh != self.nkv)
        g = self.nh // self.nkv
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0),
                                              attn_mask=mask, is_causal=causal)

    def attend(self, q, k, v, segments, mask):
        T = q.shape[0]
        if mask is not None:  # one call over the row, the block-diagonal causal mask
            out = self.sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), False, mask)
            return out.transpose(0, 1).reshape(T, self.nh * self.hd)
        outs = [self.sdpa(q[b:b + n].transpose(0, 1), k[b:b + n].transpose(0, 1), v[b:b + n].transpose(0, 1),
                          True).transpose(0, 1) for b, n in segments]
        return torch.cat(outs, 0).reshape(T, self.nh * self.hd)

    def forward(self, tokens, positions, segments):
        T = tokens.shape[0]
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        mask = block_causal_mask(segments, T) if self.attention == "mask" else None
        h = F.embedding(tokens, self.embed)
        for l in range(self.n_layers):
            x = self.rms_norm(h, self.w[f"model.layers.{l}.input_layernorm.weight"])
            q = self.linear(x, l, "q_proj").view(T, self.nh, self.hd)
            k = self.linear(x, l, "k_proj").view(T, self.nkv, self.hd)
            qn = self.w.get(f"model.layers.{l}.self_attn.q_norm.weight")
            if qn is not None:  # Qwen3
                q = self.rms_norm(q, qn)
                k = self.rms_norm(k, self.w[f"model.layers.{l}.self_attn.k_norm.weight"])
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            v = self.linear(x, l, "v_proj").view(T, self.nkv, self.hd)
            h = h + self.linear(self.attend(q, k, v, segments, mask), l, "o_proj")
            x = self.rms_norm(h, self.w[f"model.layers.{l}.post_attention_layernorm.weight"])
            act = F.silu(self.linear(x, l, "gate_proj")) * self.linear(x, l, "up_proj")
            h = h + self.linear(act, l, "down_proj")
        return self.rms_norm(h, self.w["model.norm.weight"])


def block_causal_mask(segments, T):
    """[T, T] bool, True where a position may attend: earlier or equal positions of its own sample."""
    seg = torch.empty(T, dtype=torch.long)
    for i, (b, n) in enumerate(segments):
        seg[b:b + n] = i
    idx = torch.arange(T)
    return (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])


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
            ents.append(-(logp.exp().mul_(logp)).sum(-1))
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
    """Forward, GRPO loss and backward over every prepared row (gradients accumulate)."""
    for row in rows:
        lp, _ = row_logprobs(model, row, chunk)
        with torch.no_grad():
            mu = lp.detach() - 0.01
            adv = torch.full_like(lp, 0.5)
            w = torch.clamp(torch.exp(lp.detach() - mu), max=2.0)
        ratio = torch.exp(lp - lp.detach())
        loss = -w * torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
        (loss.sum() / denominator).backward()


def make_optimizer(params):
    """AdamW as lorasync's (rl/optimizer.h defaults: betas 0.9/0.95, eps 1e-8, no weight decay)."""
    return torch.optim.AdamW(params, lr=4e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)


def train_step(model, rows, chunk, denominator, opt, params):
    """One full step; returns its figures: fwd_bwd_s, opt_s, minflt, majflt."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    step(model, rows, chunk, denominator)
    t1 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"fwd_bwd_s": t1 - t0, "opt_s": t2 - t1, "minflt": r1.ru_minflt - r0.ru_minflt,
            "majflt": r1.ru_majflt - r0.ru_majflt}


# FNV-1a over 64-bit values (bench_train.cpp's rows_checksum computes the same).
FNV_OFFSET, FNV_PRIME, MASK64 = 0xcbf29ce484222325, 0x100000001b3, (1 << 64) - 1


def rows_checksum(rows):
    """16 hex digits over the row count, then per row its sample count, per sample its prompt and
    completion lengths and their token ids."""
    h = FNV_OFFSET

    def mix(v):
        nonlocal h
        h = ((h ^ (v & MASK64)) * FNV_PRIME) & MASK64

    mix(len(rows))
    for row in rows:
        mix(len(row))
        for s in row:
            mix(len(s["prompt"]))
            mix(len(s["completion"]))
            for t in s["prompt"]:
                mix(t)
            for t in s["completion"]:
                mix(t)
    return f"{h:016x}"


def read_rows(path):
    """The rows file; raises ValueError when its checksum disagrees with its rows."""
    spec = json.load(open(path))
    got = rows_checksum(spec["rows"])
    if "checksum" in spec and spec["checksum"] != got:
        raise ValueError(f"{path}: the rows' checksum is {got}, the file says {spec['checksum']}")
    spec["checksum"] = got
    return spec


def row_counts(spec):
    """Tokens (prompt + completion) and completion tokens per step: what tokens/s counts."""
    tokens = sum(len(s["prompt"]) + len(s["completion"]) for row in spec["rows"] for s in row)
    completion = sum(len(s["completion"]) for row in spec["rows"] for s in row)
    return tokens, completion


def summary(steps):
    """Per-figure lists of a list of train_step results."""
    return {k: [s[k] for s in steps] for k in ("fwd_bwd_s", "opt_s", "minflt", "majflt")}


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", required=True)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--logits-chunk", type=int, default=512)
    ap.add_argument("--attention", choices=ATTENTION, default="segments",
                    help="segments: one SDPA per sample (causal); mask: one per row, block-diagonal mask")
    ap.add_argument("--serve", action="store_true", help="answer `steps N` / `quit` lines on stdin")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    model = Model(cfg, load_weights(args.model), args.rank, args.alpha, seed=1, attention=args.attention)
    spec = read_rows(args.rows)
    rows = [prepare(r) for r in spec["rows"]]
    tokens, completion = row_counts(spec)
    params = model.parameters()
    opt = make_optimizer(params)
    info = {"tokens_per_step": tokens, "completion_tokens_per_step": completion, "rows": len(rows),
            "checksum": spec["checksum"], "threads": torch.get_num_threads(), "torch": torch.__version__,
            "attention": args.attention, "enable_gqa": HAS_GQA,
            "malloc_env": {k: v for k, v in os.environ.items()
                           if k.startswith("MALLOC_") or k in ("LD_PRELOAD", "THP_MEM_ALLOC_ENABLE")}}
    run = lambda: train_step(model, rows, args.logits_chunk, spec["denominator"], opt, params)  # noqa: E731
    if args.serve:
        emit({"ready": True, **info})
        for line in sys.stdin:
            cmd = line.split()
            if cmd[:1] == ["steps"] and len(cmd) == 2:
                emit(summary([run() for _ in range(int(cmd[1]))]))
            elif cmd == ["quit"]:
                emit({"peak_rss_mib": peak_rss_mib()})
                return
            else:
                emit({"error": f"unknown command {line.strip()!r}"})
        return
    run()  # warm-up
    s = summary([run() for _ in range(args.steps)])
    step_s = [a + b for a, b in zip(s["fwd_bwd_s"], s["opt_s"])]
    emit({**info, **s, "step_s_best": min(step_s), "step_s_median": statistics.median(step_s),
          "trained_tokens_per_s": tokens / min(step_s), "peak_rss_mib": peak_rss_mib()})


if __name__ == "__main__":
    main()
