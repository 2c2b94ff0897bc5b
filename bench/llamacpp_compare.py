#!/usr/bin/env python3
"""bench/llamacpp_compare.py: lorasync's prefill and decode against llama.cpp on the same model, in
one run (issue 14's table). Python standard library only.

The model is a random `small` preset (or any preset) written by `lorasync init-model` and converted
to an f32 GGUF by llama.cpp's own converter, so both engines run the same shapes in the same dtype
on the same threads. Each measurement alternates the two engines (ours, theirs, ours, theirs ...)
and keeps the best of each, so a noisy neighbour hurts both alike.

llama.cpp is a peer, never part of this repository: get its sources into a temporary directory
(for example `pip download llama-cpp-python --no-binary :all: --no-deps`, whose sdist carries
them under vendor/llama.cpp), build `llama-bench`, `llama-batched-bench` and `llama-server` there with
`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF && cmake --build build
--target llama-bench llama-batched-bench llama-server`, and install `sentencepiece` next to its converter
(`pip install --target DIR sentencepiece`, passed as --pythonpath DIR). Then:

  python3 bench/llamacpp_compare.py --llama-src /tmp/llama.cpp \\
      [--lorasync build/release/apps/lorasync/lorasync] [--work /tmp/lcmp] [--preset small] \\
      [--threads 2] [--batches 1,8,64] [--context 128] [--steps 32] [--rounds 2] \\
      [--serve [--streams 1,8,64] [--port 18090]]

With --serve, the same model end to end as well: llama-server and `lorasync serve` started in turn on the same threads, each measured by the
same `lorasync bench serve --url` client (random token-id prompts, ignore_eos, the servers' own
token counts) at --streams, best of --rounds; ratios > 1 mean lorasync is faster (tokens/s ours
over theirs, TTFT and inter-token p50 theirs over ours).

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
import time
import urllib.request


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


def serve_phase(a, gguf):
    """Each server in turn (llama-server, then lorasync serve; --rounds times), measured by the same
    `lorasync bench serve --url` client: {(metric, streams): (ours, theirs)}, best of the rounds
    (tokens/s the highest, latencies the lowest)."""
    hf = os.path.dirname(gguf)
    bin_dir = os.path.join(a.llama_src, "build", "bin")
    cmds = {
        "llama.cpp": [os.path.join(bin_dir, "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port",
                      str(a.port + 1), "-t", str(a.threads), "-tb", str(a.threads), "-np", "64", "-c", "8192",
                      "--no-webui"],
        "lorasync": [a.lorasync, "serve", "--model", hf, "--served-model-name", "model", "--port", str(a.port),
                     "--threads", str(a.threads)],
    }
    ports = {"llama.cpp": a.port + 1, "lorasync": a.port}
    best = {}
    for _ in range(a.rounds):
        for who in ("llama.cpp", "lorasync"):
            log = open(os.path.join(a.work, f"{who}-server.log"), "w")
            srv = subprocess.Popen(cmds[who], stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{ports[who]}"
                for _ in range(240):
                    try:
                        urllib.request.urlopen(url + "/health", timeout=1).read()
                        break
                    except Exception:
                        if srv.poll() is not None:
                            sys.exit(f"{who} server exited ({srv.returncode}); see {log.name}")
                        time.sleep(0.5)
                else:
                    sys.exit(f"{who} server did not become healthy; see {log.name}")
                out = sh([a.lorasync, "bench", "serve", "--url", url, "--served-model", "model",
                          "--concurrency", a.streams])
            finally:
                srv.terminate()
                srv.wait()
                log.close()
            for line in out.splitlines():
                if not line.startswith("{"):
                    continue
                j = json.loads(line)
                key = (j["metric"], j["config"].get("concurrency"))
                if key[0] not in ("generated_tokens_per_s", "ttft_p50_ms", "itl_p50_ms"):
                    continue
                pick = max if key[0] == "generated_tokens_per_s" else min
                prev = best.setdefault(key, {}).get(who)
                best[key][who] = j["value"] if prev is None else pick(prev, j["value"])
    return best


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
    ap.add_argument("--serve", action="store_true",
                    help="also compare the servers end to end (llama-server built beside llama-bench)")
    ap.add_argument("--streams", default="1,8,64", help="concurrent streams of the --serve phase")
    ap.add_argument("--port", type=int, default=18090, help="lorasync serve's port; llama-server's is the next")
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
    if not a.serve:
        return
    best = serve_phase(a, gguf)
    print(f"\n{'bench serve --url':28} {'lorasync':>10} {'llama-srv':>10} {'ratio':>7}", file=sys.stderr)
    for (metric, streams), v in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        o, t = v.get("lorasync"), v.get("llama.cpp")
        # tokens/s: ours over theirs; latencies: theirs over ours (> 1: we are faster either way)
        ratio = (o / t if metric == "generated_tokens_per_s" else t / o) if o and t else None
        print(f"{metric + ', ' + str(streams) + ' streams':28} {o or float('nan'):10.1f} {t or float('nan'):10.1f} "
              f"{ratio or float('nan'):7.2f}", file=sys.stderr)
        print(json.dumps({"bench": "llamacpp_compare", "metric": "serve_" + metric, "value": o,
                          "unit": "ms" if metric.endswith("_ms") else "tokens/s", "baseline": t, "ratio": ratio,
                          "config": {"preset": a.preset, "concurrency": streams, "threads": a.threads,
                                     "rounds": a.rounds}}))


if __name__ == "__main__":
    main()
