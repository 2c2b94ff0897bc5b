"""TRL's asynchronous GRPO trainer (trl.experimental.async_grpo, from PyPI, unmodified) trains a
LoRA adapter against `lorasync proxy` in front of two `lorasync serve` replicas, on CPU.

TRL's own client code does everything: it probes `/health` and `/server_info` (and picks
adapter-only sync from `lora_config`), asks `/v1/models` for `max_model_len`, generates with
`/v1/completions` (token-id prompts, `return_token_ids`, `logprobs: 0`, a 63-bit seed), and on
every sync pauses, saves the adapter with PEFT, loads it as `trl-policy-v{N}` through
`/v1/load_lora_adapter`, resumes and unloads the version that fell out of its staleness window.

What had to be provided from outside TRL to run it here (nothing in TRL is changed):
  * TRL's training forward uses its `tree_fa3` attention, which loads
    `kernels-community/flash-attn3` from the kernel hub (CUDA builds only, and no downloads
    here). The `kernels` package's documented local override (LOCAL_KERNELS) points it at
    tests/conformance/trl_async/cpu_flash_attn, a CPU `flash_attn_varlen_func` in PyTorch, checked
    against PyTorch's attention below.
  * TRL's rollout worker refuses to start unless the `vllm` package is installed, although it
    never imports it (generation goes over HTTP with aiohttp). The vLLM versions TRL 1.16
    supports (0.22-0.31) cannot be installed next to the pinned torch 2.11 (pip reports the
    conflict) and are CUDA builds, so the driver rebinds that one availability check.
  * The trainer's constructor calls `torch.cuda.get_device_name()` to size its MFU metrics
    (`get_peak_flops_per_device`), which raises on a machine without a GPU; the driver rebinds
    that name to answer "unknown" (None), TRL's own answer for a device it has no figures for.

Checked: the run ends, TRL's logged metrics are finite, both replicas hold exactly the adapter
versions TRL intends (the last `max_staleness + 1`, same bytes on both), the replicas served
TRL's generations under the adapter names it asked for (per-name request counts on each
replica) and never the base model, and a completion's provenance block names the version and
its sha256.
"""
import json
import math
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import SHARED, figure, lorasync, proxy, serve

HERE = Path(__file__).resolve().parent
KERNEL_DIR = HERE / "trl_async" / "cpu_flash_attn"
DRIVER = HERE / "trl_async" / "run_async_grpo.py"
MAX_STEPS, MAX_STALENESS, G = 3, 1, 4


def get_json(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def post_json(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def adapter_requests(metrics_text):
    """{model name: count} from serve's `adapter_requests_total{model="..."}` series."""
    out = {}
    for m in re.finditer(r'^lorasync_server_adapter_requests_total\{model="([^"]*)"\} (\S+)$',
                         metrics_text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def use_qwen2_5_chat_template(model_dir):
    """TRL's rollout worker parses responses with a schema it picks by recognising the tokenizer's
    chat template among the models it knows; the shared tokenizer's template is not one of them.
    The test model gets Qwen2.5-Instruct's template (as TRL ships it), as a real Qwen2.5 would."""
    import trl
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))


def test_cpu_flash_attn_matches_torch_attention():
    """The CPU kernel against PyTorch's own attention, per packed sequence (GQA, causal with
    queries aligned to the last keys, as tree attention uses it)."""
    sys.path.insert(0, str(KERNEL_DIR.parent))
    from cpu_flash_attn import flash_attn_varlen_func
    g = torch.Generator().manual_seed(0)
    lens_q, lens_k = [3, 5, 1], [7, 5, 4]
    q = torch.randn(sum(lens_q), 4, 8, generator=g)
    k = torch.randn(sum(lens_k), 2, 8, generator=g)
    v = torch.randn(sum(lens_k), 2, 8, generator=g)
    cq = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    ck = torch.tensor([0, 7, 12, 16], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 5, 7, causal=True)
    for i in range(3):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)
        ks = k[ck[i]:ck[i + 1]].transpose(0, 1).repeat_interleave(2, 0)
        vs = v[ck[i]:ck[i + 1]].transpose(0, 1).repeat_interleave(2, 0)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        assert torch.allclose(out[cq[i]:cq[i + 1]], ref.transpose(0, 1), atol=1e-5)


def test_trl_async_grpo_trains_against_proxy_and_two_replicas(tmp):
    model = tmp / "tiny"
    lorasync("init-model", "--preset", "tiny", "--seed", 3, "--init-std", 0.1, "--output", model)
    use_qwen2_5_chat_template(model)
    run = tmp / "run"
    lora_root = run / ".vllm_lora"  # where TRL saves `trl-policy-v{N}` (output_dir/.vllm_lora)
    lora_root.mkdir(parents=True)
    # TRL names the base model by the path it loaded it from; vLLM's default served name is the
    # same path, so the replicas are started the way `vllm serve <path>` would name it.
    common = ["--served-model-name", str(model), "--max-loras", MAX_STALENESS + 2 + 1,
              "--max-lora-rank", 8, "--allowed-adapter-root", lora_root]
    replicas = [serve(model, *common) for _ in range(2)]
    px = proxy([r.url for r in replicas])
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
        p = subprocess.run(
            [sys.executable, str(DRIVER), "--model", str(model), "--server", px.url,
             "--data", str(SHARED / "data" / "math_sanity_1k5.jsonl"), "--output-dir", str(run),
             "--max-steps", str(MAX_STEPS), "--num-generations", str(G),
             "--max-staleness", str(MAX_STALENESS), "--cpu-attention", str(KERNEL_DIR),
             "--cpu-shims"],
            capture_output=True, text=True, timeout=780, env=env)
        if p.returncode != 0:
            pytest.fail(f"TRL exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}\n"
                        f"proxy:\n{px.stderr()[-2000:]}\nreplica 0:\n{replicas[0].stderr()[-2000:]}")
        done = [json.loads(l) for l in p.stdout.splitlines() if l.startswith('{"event": "trained"')]
        assert done, p.stdout[-2000:]
        version = done[-1]["model_version"]
        # One sync at train begin, then one per step.
        assert done[-1]["global_step"] == MAX_STEPS and version == MAX_STEPS + 1

        # TRL's logged metrics are finite.
        logs = [json.loads(l) for l in (run / "trl_logs.jsonl").read_text().splitlines()]
        train_logs = [l for l in logs if "loss" in l]
        assert len(train_logs) >= MAX_STEPS, logs
        assert any(l.get("grad_norm", 0) > 0 for l in train_logs), train_logs  # it learned something
        for entry in logs:
            for key, value in entry.items():
                if isinstance(value, (int, float)):
                    assert math.isfinite(value), f"{key} = {value} in {entry}"

        # Both replicas hold exactly the versions TRL keeps, with the same bytes.
        want = {f"trl-policy-v{v}" for v in range(version - MAX_STALENESS, version + 1)}
        held = []
        for r in replicas:
            models = get_json(r.url + "/v1/models")["data"]
            held.append({m["id"]: m.get("adapter_sha256") for m in models if m["id"] != str(model)})
        assert set(held[0]) == want and set(held[1]) == want, held
        assert held[0] == held[1]

        # The replicas generated TRL's rollouts under the adapter names it asked for.
        per_replica = [adapter_requests(urllib.request.urlopen(r.url + "/metrics").read().decode())
                       for r in replicas]
        asked = {}
        for counts in per_replica:
            for name, n in counts.items():
                asked[name] = asked.get(name, 0) + n
        assert asked.get(str(model), 0) == 0, asked  # never the base model
        assert asked.get("trl-policy-v1", 0) > 0, asked
        assert set(asked) <= {f"trl-policy-v{v}" for v in range(1, version + 1)} | {str(model)}
        assert all(sum(c.values()) > 0 for c in per_replica), per_replica  # both replicas served

        # Provenance: a completion through the proxy names the version and its bytes.
        latest = f"trl-policy-v{version}"
        out = post_json(px.url + "/v1/completions",
                        {"model": latest, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
        assert out["lorasync"]["adapter"] == latest
        assert out["lorasync"]["adapter_sha256"] == held[0][latest]

        figure("trl_async_grpo_steps", MAX_STEPS, adapter_versions=version,
               requests_per_version={k: int(v) for k, v in sorted(asked.items())},
               requests_per_replica=[int(sum(c.values())) for c in per_replica],
               reward=[l.get("reward") for l in train_logs], loss=[l.get("loss") for l in train_logs])
    finally:
        px.stop()
        for r in replicas:
            r.stop()
