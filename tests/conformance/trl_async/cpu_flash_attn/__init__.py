"""A CPU build of the one FlashAttention entry point TRL's tree attention calls.

TRL's `AsyncGRPOTrainer` loads its model with the `tree_fa3` attention, which fetches
`kernels-community/flash-attn3` from the Hugging Face kernel hub and calls its
`flash_attn_varlen_func`. That hub kernel has CUDA builds only, and nothing may be downloaded
here. The `kernels` package lets a user substitute a local build of a hub kernel
(`LOCAL_KERNELS=kernels-community/flash-attn3=<this directory>`); this directory is such a build,
for CPU, in plain PyTorch (autograd gives the backward). It is used by the TRL conformance test
only; TRL's own code is not modified.

Semantics are FlashAttention's: packed `q [Tq, H, D]`, `k, v [Tk, Hkv, D]` (grouped-query heads
when Hkv < H), sequence i spanning `cu_seqlens_q[i]:cu_seqlens_q[i+1]` and
`cu_seqlens_k[i]:cu_seqlens_k[i+1]`; `causal` aligns the mask to the bottom-right corner (query
row r of an Lq x Lk block sees keys up to r + Lk - Lq), and `window_size = (left, right)` limits
it further (-1 = unlimited).
"""
import torch


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **unused):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected packed [T, H, D] tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries, cu_seqlens_k {len(ck)}")
    left, right = window_size
    out = []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1).float()  # [H, Lq, D]
        ks = k[ck[i]:ck[i + 1]].transpose(0, 1).float()
        vs = v[ck[i]:ck[i + 1]].transpose(0, 1).float()
        if kv_heads != heads:
            ks = ks.repeat_interleave(heads // kv_heads, dim=0)
            vs = vs.repeat_interleave(heads // kv_heads, dim=0)
        lq, lk = qs.shape[1], ks.shape[1]
        scores = (qs @ ks.transpose(-1, -2)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(lq).unsqueeze(1) + (lk - lq)
        kpos = torch.arange(lk).unsqueeze(0)
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= kpos <= qpos
        if left >= 0:
            allowed &= kpos >= qpos - left
        if right >= 0:
            allowed &= kpos <= qpos + right
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key attends to nothing
        out.append((probs @ vs).transpose(0, 1).to(q.dtype))
    return torch.cat(out, dim=0)
