"""Shared helpers of the conformance tests: lorasync against the real Hugging Face stack.

The tests run in the project's .venv (scripts/setup) under ctest (label `conformance`), which
passes LORASYNC_BINARY and LORASYNC_SHARED_DIR. Everything is local: random models made by
`lorasync init-model`, servers on port 0 of 127.0.0.1, temp directories; nothing is downloaded
(HF_HUB_OFFLINE is forced). Each test prints the figures it measured.
"""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[2]
BINARY = os.environ.get("LORASYNC_BINARY", str(ROOT / "build/release/apps/lorasync/lorasync"))
SHARED = Path(os.environ.get("LORASYNC_SHARED_DIR", str(ROOT.parent / "shared")))


def lorasync(*args, check=True, timeout=600, input=None):
    """Runs the lorasync binary; returns the CompletedProcess (text). Fails the test on error."""
    cmd = [BINARY, *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-4000:]}")
    return p


def write_config(path: Path, **overrides):
    """A Qwen2 config.json for a small random model (transformers' key names)."""
    cfg = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False,
        "attention_dropout": 0.0,
    }
    cfg.update(overrides)
    path.write_text(json.dumps(cfg, indent=2))
    return cfg


def make_model(tmp: Path, name="model", seed=1, init_std=0.08, tokenizer="none", **overrides):
    """A random Qwen2 by `lorasync init-model --config`: returns its directory."""
    cfg_path = tmp / f"{name}.config.json"
    write_config(cfg_path, **overrides)
    out = tmp / name
    lorasync("init-model", "--config", cfg_path, "--output", out, "--seed", seed,
             "--init-std", init_std, "--tokenizer", tokenizer)
    return out


def random_rows(seed, vocab, n=3, completion_step=3):
    """n {prompt_ids, completion_ids} rows of random ids in [3, vocab): prompts of 5 + 7i tokens,
    completions of 4 + completion_step * i."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(3, vocab, (5 + 7 * i,), generator=g).tolist()
        c = torch.randint(3, vocab, (4 + completion_step * i,), generator=g).tolist()
        out.append({"prompt_ids": p, "completion_ids": c})
    return out


def lorasync_logits(tmp: Path, model, items, adapter=None):
    """`lorasync logprobs --logits-out` on {prompt_ids, completion_ids} rows: (per-row fp32 logits
    over prompt + completion, per-row completion logprobs)."""
    from safetensors.torch import load_file
    inp = tmp / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in items))
    out = tmp / "logits.safetensors"
    args = ["logprobs", "--model", model, "--input", inp, "--logits-out", out, "--threads", 2]
    if adapter:
        args += ["--adapter", adapter]
    p = lorasync(*args)
    lps = [json.loads(line)["logprobs"] for line in p.stdout.splitlines() if line.strip()]
    logits = load_file(str(out))
    return [logits[f"logits.{i}"] for i in range(len(items))], lps


def torch_logits(model, items):
    """The same figures from a transformers / PEFT model, one forward per row."""
    import torch
    res_logits, res_lps = [], []
    with torch.no_grad():
        for r in items:
            logits = model(torch.tensor([r["prompt_ids"] + r["completion_ids"]])).logits[0].float()
            res_logits.append(logits)
            P = len(r["prompt_ids"])
            logp = torch.log_softmax(logits, -1)
            res_lps.append([logp[P - 1 + t, tok].item() for t, tok in enumerate(r["completion_ids"])])
    return res_logits, res_lps


def compare_logits(name, a, b, tol=1e-4):
    """Both (logits, logprobs) pairs agree within tol; the figure is recorded either way."""
    (la, pa), (lb, pb) = a, b
    d_logits = max((x - y).abs().max().item() for x, y in zip(la, lb))
    d_lps = max(abs(x - y) for u, v in zip(pa, pb) for x, y in zip(u, v))
    figure(name, d_logits, max_abs_logprob_diff=d_lps, tolerance=tol)
    assert d_logits <= tol, f"{name}: logits differ by {d_logits}"
    assert d_lps <= tol, f"{name}: logprobs differ by {d_lps}"


class Server:
    """A `lorasync serve` or `lorasync proxy` child on a free port of 127.0.0.1."""

    def __init__(self, args, port_key, env=None):
        self.proc = subprocess.Popen([BINARY, *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self._err = []
        threading.Thread(target=lambda: self._err.extend(self.proc.stderr), daemon=True).start()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(5)
            raise RuntimeError(f"{args[0]} did not start: {''.join(self._err)[-3000:]}")
        j = json.loads(line)
        self.port = int(j["port"]) if port_key == "port" else int(j["listening"].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stderr(self):
        return "".join(self._err)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def serve(model_dir, *extra):
    return Server(["serve", "--model", model_dir, "--port", 0, "--kv-cache-memory", "64MiB",
                   "--max-model-len", 512, *extra], "port")


def proxy(upstreams, *extra, env=None):
    args = ["proxy", "--listen", "127.0.0.1:0"]
    for u in upstreams:
        args += ["--upstream", u]
    return Server(args + list(extra), "listening", env=env)


def figure(name, value, **details):
    """Prints one measured figure as a JSON line, and appends it to $LORASYNC_FIGURES (set by
    ctest; scripts/test prints that file after the run, so CI's log shows every figure)."""
    row = {"conformance": name, "value": value, **details}
    line = json.dumps(row)
    print(line, file=sys.stdout, flush=True)
    path = os.environ.get("LORASYNC_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.fixture
def tmp(tmp_path):
    return tmp_path
