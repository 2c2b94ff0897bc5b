#!/usr/bin/env python3
"""bench/llamacpp_compare.py: lorasync's prefill and decode against llama.cpp on the same model, in
one run (issue 14's table). Python standard library only.

The model is a random `small` preset (or any preset) written by `lorasync init-model` and converted
to an f32 GGUF by llama.cpp's own converter, so both engines run the same shapes in the same dtype
on the same threads. Each measurement alternates the two engines (ours, theirs, ours, theirs ...)
and keeps the best of each, so a noisy neighbour hurts both alike.

llama.cpp is a peer, never part of this repository: get its sources into a temporary directory
(for example `pip download llama-cpp-python --no-binary :all: --no-deps`, whose sdist carries
them under vendor/llama.cpp), build `llama-bench` and `llama-batched-bench` there with
`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF && cmake --build build
--target llama-bench llama-batched-bench`, and install `sentencepiece` next to its converter
(`pip install --target DIR sentencepiece`, passed as --pythonpath DIR). Then:

  python3 bench/llamacpp_compare.py --llama-src /tmp/llama.cpp \\
      [--lorasync build/release/apps/lorasync/lorasync] [--work /tmp/lcmp] [--preset small] \\
      [--threads 2] [--batches 1,8,64] [--context 128] [--steps 32] [--rounds 2]

Prints a table on stderr and one JSON object per row on stdout:
  prefill (512 tokens, one sequence): ours = `bench forward` prefill, theirs = llama-bench pp512;
  decode at batch b after `context` cached tokens, LM head on every new token, no sampling:
  ours = `bench forward` decode, theirs = llama-batched-bench S_TG (npp = context, ntg = steps).
"""
import argparse
import json
import os
import subprocess
import sys


def sh(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def prepare(a):
    """The HF directory and its GGUF conversion (made once, reused)."""
    hf = os.path.join(a.work, a.preset)
    gguf = os.path.join(hf, "model-f32.gguf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        sh([a.lorasync, "init-model", "--preset", a.preset, "--output", hf, "--tokenizer", a.tokenizer,
            "--dtype", "float32"])
    if not os.path.exists(gguf):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [os.path.join(a.llama_src, "gguf-py"), a.pythonpath, env.get("PYTHONPATH", "")] if p)
        sh([a.python, os.path.join(a.llama_src, "convert_hf_to_gguf.py"), hf, "--outtype", "f32",
            "--outfile", gguf], env=env)
    return gguf


def ours(a):
    """{("prefill", 1) or ("decode", b): tokens/s} from one `lorasync bench forward` run."""
    out = sh([a.lorasync, "bench", "forward", "--presets", a.preset, "--threads", str(a.threads),
              "--prompt-tokens", "512", "--prefill-batch", "1", "--decode-batches", a.batches,
              "--context", str(a.context), "--decode-steps", str(a.steps), "--repeats", "2",
              "--paths", "fast", "--adapters", "0"])
    r = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if j["metric"] == "prefill_tokens_per_s":
            r[("prefill", 1)] = j["value"]
        elif j["metric"] == "decode_tokens_per_s":
            r[("decode", j["config"]["batch"])] = j["value"]
    return r


def theirs(a, gguf):
    bin_dir = os.path.join(a.llama_src, "build", "bin")
    r = {}
    out = sh([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(a.threads), "-p", "512", "-n", "0",
              "-r", "3", "-o", "json"])
    for t in json.loads(out):
        if t.get("n_prompt") == 512 and t.get("n_gen") == 0:
            r[("prefill", 1)] = t["avg_ts"]
    batches = [int(b) for b in a.batches.split(",")]
    ctx = max(batches) * (a.context + a.steps) + 64
    out = sh([os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-t", str(a.threads), "-tb",
              str(a.threads), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(a.context), "-ntg",
              str(a.steps), "-npl", a.batches, "--output-format", "jsonl"])
    for line in out.splitlines():
        if line.startswith("{"):
            j = json.loads(line)
            r[("decode", j["pl"])] = j["speed_tg"]
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    ap.add_argument("--llama-src", required=True, help="a llama.cpp source tree with build/bin/llama-bench")
    ap.add_argument("--lorasync", default=os.path.join(root, "build/release/apps/lorasync/lorasync"))
    ap.add_argument("--work", default="/tmp/lorasync-llamacpp")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokenizer", default=os.path.join(root, "../shared/data/qwen2-tokenizer"))
    ap.add_argument("--python", default=os.path.join(root, ".venv/bin/python"), help="runs the converter")
    ap.add_argument("--pythonpath", default="", help="extra PYTHONPATH for the converter (sentencepiece)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    gguf = prepare(a)
    best_o, best_t = {}, {}
    for _ in range(a.rounds):
        for k, v in ours(a).items():
            best_o[k] = max(best_o.get(k, 0.0), v)
        for k, v in theirs(a, gguf).items():
            best_t[k] = max(best_t.get(k, 0.0), v)
    print(f"{'':28} {'lorasync':>10} {'llama.cpp':>10} {'ratio':>7}", file=sys.stderr)
    for k in sorted(best_o, key=lambda k: (k[0] != "prefill", k[1])):
        o, t = best_o[k], best_t.get(k)
        name = "prefill, 512 tokens" if k[0] == "prefill" else f"decode, batch {k[1]} (ctx {a.context})"
        ratio = o / t if t else None
        print(f"{name:28} {o:10.1f} {t or float('nan'):10.1f} {ratio or float('nan'):7.2f}", file=sys.stderr)
        print(json.dumps({"bench": "llamacpp_compare", "metric": f"{k[0]}_tokens_per_s", "value": o,
                          "unit": "tokens/s", "baseline": t, "ratio": ratio,
                          "config": {"preset": a.preset, "batch": k[1], "threads": a.threads,
                                     "context": a.context, "steps": a.steps}}))


if __name__ == "__main__":
    main()
