#!/usr/bin/env python3
"""bench/llamacpp_compare.py: lorasync's prefill and decode against llama.cpp on the same model, in
one run (issue 14's table). Python standard library only.

The model is a random `small` preset (or any preset) written by `lorasync init-model` and converted
to an f32 GGUF by llama.cpp's own converter, so both engines run the same shapes in the same dtype
on the same threads. Both sides report the same statistic: the best of --repeats individual runs
(ours: `bench forward --repeats N`, each repeat one timed prefill or decode after a warm-up;
theirs: llama-bench's per-repetition samples_ns with -r N after its warm-up, and N runs of
llama-batched-bench, one S_TG per batch size each after a warm-up of that shape). Each of --rounds rounds runs both engines, the order swapped
every round (ours first in even rounds, theirs first in odd ones), so that a drift of the machine's
pace hurts both alike. Reported per measurement: the best of each over all rounds and their ratio,
the per-round ratios (each round's best against best) and their median (`ratio_median`, the
figure to read when the two disagree).

llama.cpp is a peer, never part of this repository: get its sources into a temporary directory
(for example `pip download llama-cpp-python --no-binary :all: --no-deps`, whose sdist carries
them under vendor/llama.cpp), build `llama-bench`, `llama-batched-bench` and `llama-server` there with
`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF && cmake --build build
--target llama-bench llama-batched-bench llama-server`, and install `sentencepiece` next to its converter
(`pip install --target DIR sentencepiece`, passed as --pythonpath DIR). Then:

  python3 bench/llamacpp_compare.py --llama-src /tmp/llama.cpp \\
      [--lorasync build/release/apps/lorasync/lorasync] [--work /tmp/lcmp] [--preset small] \\
      [--threads 2] [--batches 1,8,64] [--context 128] [--steps 32] [--rounds 4] [--repeats 3] \\
      [--serve [--streams 1,8,64] [--port 18090]]

With --serve, the same model end to end as well: llama-server and `lorasync serve` started in turn
on the same threads (the order swapped every round), each measured by the same `lorasync bench
serve --url` client (random token-id prompts, ignore_eos, the servers' own token counts) at
--streams: best of --rounds on each side, the per-round ratios and their median; ratios > 1 mean
lorasync is faster (tokens/s ours over theirs, TTFT and inter-token p50 theirs over ours).

Prints a table on stderr and one JSON object per row on stdout:
  prefill (512 tokens, one sequence): ours = `bench forward` prefill, theirs = llama-bench pp512;
  decode at batch b after `context` cached tokens, LM head on every new token, no sampling:
  ours = `bench forward` decode, theirs = llama-batched-bench S_TG (npp = context, ntg = steps).

`--self-test` checks the parsing of both tools' outputs and the rounds' arithmetic on synthetic
outputs (no llama.cpp needed; tests/bench/test_llamacpp_compare.py runs the same checks in ctest).
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


def parse_ours(out):
    """{("prefill", 1) or ("decode", b): tokens/s} from `lorasync bench forward` JSON lines (each
    already the best of its --repeats timings)."""
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


def parse_llama_bench(out, n_prompt):
    """The per-repetition tokens/s of llama-bench's `-o json` (an array) or `-o jsonl` (an object a
    line) for the prompt-only test of `n_prompt` tokens: [tokens/s of each repetition]. llama-bench
    counts n_prompt + n_gen tokens per repetition over samples_ns (its get_ts()); samples_ts (the same,
    rounded) and avg_ts (the mean: only when neither is there) are the fallbacks."""
    text = out.strip()
    if text.startswith("["):
        tests = json.loads(text)
    else:
        tests = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    for t in tests:
        if t.get("n_prompt") != n_prompt or t.get("n_gen") != 0 or t.get("n_depth", 0) != 0:
            continue
        tokens = t["n_prompt"] + t["n_gen"]
        if t.get("samples_ns"):
            return [1e9 * tokens / ns for ns in t["samples_ns"]]
        if t.get("samples_ts"):
            return [float(x) for x in t["samples_ts"]]
        return [float(t["avg_ts"])]
    return []


def parse_batched_bench(out):
    """{("decode", pl): S_TG} from one llama-batched-bench run with `--output-format jsonl` (a JSON
    object a line among its log lines). A batch size listed twice in -npl keeps its last line: the
    first is the warm-up of that shape."""
    r = {}
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            j = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "pl" in j and "speed_tg" in j:
            r[("decode", int(j["pl"]))] = float(j["speed_tg"])
    return r


def best_of(runs):
    """The best (highest) tokens/s per key over runs ({key: tokens/s} or {key: [tokens/s, ...]})."""
    best = {}
    for run in runs:
        for k, v in run.items():
            for x in (v if isinstance(v, list) else [v]):
                best[k] = max(best.get(k, 0.0), x)
    return best


def ours(a):
    """{("prefill", 1) or ("decode", b): tokens/s}, each the best of --repeats individual timings."""
    return parse_ours(sh([a.lorasync, "bench", "forward", "--presets", a.preset, "--threads", str(a.threads),
                          "--prompt-tokens", "512", "--prefill-batch", "1", "--decode-batches", a.batches,
                          "--context", str(a.context), "--decode-steps", str(a.steps), "--repeats",
                          str(a.repeats), "--paths", "fast", "--adapters", "0"]))


def theirs(a, gguf):
    """The same keys: llama-bench's best repetition of -r --repeats (pp512, after its warm-up run),
    and the best S_TG of --repeats llama-batched-bench runs (one timing per batch size each, after a
    warm-up of the same shape: every batch size is listed twice in -npl and the first is dropped, as
    `bench forward` warms each shape before timing it)."""
    bin_dir = os.path.join(a.llama_src, "build", "bin")
    runs = [{("prefill", 1): parse_llama_bench(
        sh([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(a.threads), "-p", "512", "-n", "0",
            "-r", str(a.repeats), "-o", "json"]), 512)}]
    batches = [int(b) for b in a.batches.split(",")]
    npl = ",".join(f"{b},{b}" for b in batches)  # each shape twice: a warm-up, then the timing kept
    ctx = max(batches) * (a.context + a.steps) + 64
    for _ in range(a.repeats):
        runs.append(parse_batched_bench(
            sh([os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-t", str(a.threads), "-tb",
                str(a.threads), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(a.context), "-ntg",
                str(a.steps), "-npl", npl, "--output-format", "jsonl"])))
    return best_of(runs)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return None if n == 0 else (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)


def alternate(rounds, run_ours, run_theirs, higher_is_better=lambda k: True):
    """`rounds` rounds of both sides, ours first in even rounds and theirs first in odd ones; each
    run returns {key: value}. Returns {key: {"ours", "theirs" (best over rounds), "ratio" (of the
    bests), "round_ratios", "ratio_median", "ours_per_round", "theirs_per_round"}} and the order
    per round. Ratios > 1 mean ours is better: ours/theirs where higher is better, else theirs/ours."""
    per_round, first = [], []
    for r in range(rounds):
        if r % 2 == 0:
            o = run_ours()
            t = run_theirs()
        else:
            t = run_theirs()
            o = run_ours()
        per_round.append((o, t))
        first.append("lorasync" if r % 2 == 0 else "llama.cpp")
    out = {}
    for k in sorted({k for o, _ in per_round for k in o}, key=str):
        hib = higher_is_better(k)
        pick = max if hib else min

        def ratio(o, t):
            return (o / t if hib else t / o) if o and t else None

        os_ = [o.get(k) for o, _ in per_round]
        ts_ = [t.get(k) for _, t in per_round]
        ro = [ratio(o, t) for o, t in zip(os_, ts_)]
        bo = pick([x for x in os_ if x is not None], default=None)
        bt = pick([x for x in ts_ if x is not None], default=None)
        out[k] = {"ours": bo, "theirs": bt, "ratio": ratio(bo, bt), "round_ratios": ro,
                  "ratio_median": median([x for x in ro if x is not None]), "ours_per_round": os_,
                  "theirs_per_round": ts_}
    return out, first


SERVE_METRICS = ("generated_tokens_per_s", "ttft_p50_ms", "itl_p50_ms")


def parse_serve(out):
    """{(metric, streams): value} of the metrics compared, from `lorasync bench serve --url` lines."""
    r = {}
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if j["metric"] in SERVE_METRICS:
            r[(j["metric"], j["config"].get("concurrency"))] = j["value"]
    return r


def serve_phase(a, gguf):
    """Each server in turn (lorasync serve and llama-server, the order swapped every round; --rounds
    rounds), measured by the same `lorasync bench serve --url` client. Returns alternate()'s
    summary: tokens/s the highest and latencies the lowest over the rounds, per-round ratios > 1
    when lorasync is faster."""
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

    def measure(who):
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
            return parse_serve(sh([a.lorasync, "bench", "serve", "--url", url, "--served-model", "model",
                                   "--concurrency", a.streams]))
        finally:
            srv.terminate()
            srv.wait()
            log.close()

    return alternate(a.rounds, lambda: measure("lorasync"), lambda: measure("llama.cpp"),
                     higher_is_better=lambda k: k[0] == "generated_tokens_per_s")


def fmt(x, spec="10.1f"):
    return format(x if x is not None else float("nan"), spec)


def forward_rows(a, summary, first):
    """The table (stderr) and JSON lines (stdout) of the prefill and decode comparison."""
    rows = []
    for k in sorted(summary, key=lambda k: (k[0] != "prefill", k[1])):
        v = summary[k]
        name = "prefill, 512 tokens" if k[0] == "prefill" else f"decode, batch {k[1]} (ctx {a.context})"
        rows.append((f"{name:28} {fmt(v['ours'])} {fmt(v['theirs'])} {fmt(v['ratio'], '7.2f')} "
                     f"{fmt(v['ratio_median'], '7.2f')}",
                     {"bench": "llamacpp_compare", "metric": f"{k[0]}_tokens_per_s", "value": v["ours"],
                      "unit": "tokens/s", "baseline": v["theirs"], "ratio": v["ratio"],
                      "config": {"preset": a.preset, "batch": k[1], "threads": a.threads, "context": a.context,
                                 "steps": a.steps, "rounds": a.rounds, "repeats": a.repeats,
                                 "statistic": "best of the individual runs on each side",
                                 "round_ratios": v["round_ratios"], "ratio_median": v["ratio_median"],
                                 "ours_per_round": v["ours_per_round"], "theirs_per_round": v["theirs_per_round"],
                                 "first_per_round": first}}))
    return rows


def serve_rows(a, summary, first):
    rows = []
    for k in sorted(summary, key=lambda k: (k[1], k[0])):
        metric, streams = k
        v = summary[k]
        rows.append((f"{metric + ', ' + str(streams) + ' streams':28} {fmt(v['ours'])} {fmt(v['theirs'])} "
                     f"{fmt(v['ratio'], '7.2f')} {fmt(v['ratio_median'], '7.2f')}",
                     {"bench": "llamacpp_compare", "metric": "serve_" + metric, "value": v["ours"],
                      "unit": "ms" if metric.endswith("_ms") else "tokens/s", "baseline": v["theirs"],
                      # tokens/s: ours over theirs; latencies: theirs over ours (> 1: we are faster either way)
                      "ratio": v["ratio"],
                      "config": {"preset": a.preset, "concurrency": streams, "threads": a.threads,
                                 "rounds": a.rounds, "statistic": "best of the rounds on each side",
                                 "round_ratios": v["round_ratios"], "ratio_median": v["ratio_median"],
                                 "ours_per_round": v["ours_per_round"], "theirs_per_round": v["theirs_per_round"],
                                 "first_per_round": first}}))
    return rows


def self_test():
    """The parsers and the rounds' arithmetic on synthetic outputs of both tools."""
    # llama-bench -o json: an array; the pp512 test's per-repetition rates from samples_ns.
    lb = json.dumps([
        {"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 900.0, "samples_ns": [640000000, 512000000, 560000000],
         "samples_ts": [800.0, 1000.0, 914.29]},
        {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 50.0, "samples_ns": [2560000000]}], indent=2)
    got = parse_llama_bench(lb, 512)
    assert [round(x, 6) for x in got] == [800.0, 1000.0, round(512e9 / 560000000, 6)], got
    assert best_of([{("prefill", 1): got}]) == {("prefill", 1): 1000.0}
    # -o jsonl, and the fallbacks: samples_ts, then avg_ts.
    jl = "\n".join(json.dumps(t) for t in [{"n_prompt": 512, "n_gen": 0, "samples_ts": [700.5, 710.25]}])
    assert parse_llama_bench(jl, 512) == [700.5, 710.25]
    assert parse_llama_bench(json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 600.0}]), 512) == [600.0]
    assert parse_llama_bench("[]", 512) == []
    # llama-batched-bench --output-format jsonl: JSON lines among its log lines.
    bb = "\n".join([
        "main: n_kv_max = 10304, n_batch = 2048",
        '{"n_kv_max": 10304, "pp": 128, "tg": 32, "pl": 1, "n_kv": 160, "t_pp": 0.5, "speed_pp": 256.0, '
        '"t_tg": 0.4, "speed_tg": 80.000000, "t": 0.9, "speed": 177.7}',
        '{"n_kv_max": 10304, "pp": 128, "tg": 32, "pl": 8, "n_kv": 1280, "t_pp": 4.0, "speed_pp": 256.0, '
        '"t_tg": 0.8, "speed_tg": 320.000000, "t": 4.8, "speed": 266.6}',
        "{not json", "llama_perf_context_print: load time = 10 ms"])
    assert parse_batched_bench(bb) == {("decode", 1): 80.0, ("decode", 8): 320.0}
    # -npl 1,1: the first line of a shape is its warm-up; the last one is kept.
    warm = "\n".join(['{"pp": 128, "tg": 32, "pl": 1, "speed_tg": 60.0}', '{"pp": 128, "tg": 32, "pl": 1, "speed_tg": 75.0}'])
    assert parse_batched_bench(warm) == {("decode", 1): 75.0}
    # Best of N runs of llama-batched-bench.
    assert best_of([{("decode", 1): 80.0}, {("decode", 1): 85.0}, {("decode", 1): 82.0}]) == {("decode", 1): 85.0}
    # Ours: bench forward's JSON lines.
    fw = "\n".join([json.dumps({"metric": "prefill_tokens_per_s", "value": 1100.0, "config": {"batch": 1}}),
                    json.dumps({"metric": "decode_tokens_per_s", "value": 90.0, "config": {"batch": 1}}),
                    json.dumps({"metric": "decode_tokens_per_s_reference", "value": 9.0, "config": {"batch": 1}}),
                    "bench forward: table"])
    assert parse_ours(fw) == {("prefill", 1): 1100.0, ("decode", 1): 90.0}
    # Rounds: the order swaps every round; best of each, per-round ratios and their median.
    calls = []
    ours_vals = iter([{("decode", 1): 100.0}, {("decode", 1): 90.0}, {("decode", 1): 120.0}])
    theirs_vals = iter([{("decode", 1): 50.0}, {("decode", 1): 100.0}, {("decode", 1): 60.0}])
    summary, first = alternate(3, lambda: calls.append("o") or next(ours_vals),
                               lambda: calls.append("t") or next(theirs_vals))
    assert calls == ["o", "t", "t", "o", "o", "t"], calls
    assert first == ["lorasync", "llama.cpp", "lorasync"]
    v = summary[("decode", 1)]
    assert v["ours"] == 120.0 and v["theirs"] == 100.0 and v["ratio"] == 1.2, v
    assert v["round_ratios"] == [2.0, 0.9, 2.0] and v["ratio_median"] == 2.0, v
    # Latencies: the lowest of each, theirs over ours; a side missing in a round gives no ratio.
    it_o = iter([{("ttft_p50_ms", 8): 10.0}, {("ttft_p50_ms", 8): 20.0}])
    it_t = iter([{("ttft_p50_ms", 8): 30.0}, {}])
    summary, _ = alternate(2, lambda: next(it_o), lambda: next(it_t), higher_is_better=lambda k: False)
    v = summary[("ttft_p50_ms", 8)]
    assert v["ours"] == 10.0 and v["theirs"] == 30.0 and v["ratio"] == 3.0, v
    assert v["round_ratios"] == [3.0, None] and v["ratio_median"] == 3.0, v
    assert median([1.0, 3.0]) == 2.0 and median([]) is None
    print("llamacpp_compare self-test: ok", file=sys.stderr)


def main():
    if "--self-test" in sys.argv[1:]:
        self_test()
        return
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
    ap.add_argument("--rounds", type=int, default=4, help="rounds of both sides, the order swapped every round")
    ap.add_argument("--repeats", type=int, default=3,
                    help="individual runs per round on each side (the best is kept): bench forward --repeats, "
                         "llama-bench -r, llama-batched-bench runs")
    ap.add_argument("--serve", action="store_true",
                    help="also compare the servers end to end (llama-server built beside llama-bench)")
    ap.add_argument("--streams", default="1,8,64", help="concurrent streams of the --serve phase")
    ap.add_argument("--port", type=int, default=18090, help="lorasync serve's port; llama-server's is the next")
    ap.add_argument("--self-test", action="store_true", help="check the parsers on synthetic outputs and exit")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    gguf = prepare(a)
    summary, first = alternate(a.rounds, lambda: ours(a), lambda: theirs(a, gguf))
    print(f"{'':28} {'lorasync':>10} {'llama.cpp':>10} {'ratio':>7} {'median':>7}", file=sys.stderr)
    for line, row in forward_rows(a, summary, first):
        print(line, file=sys.stderr)
        print(json.dumps(row))
    if not a.serve:
        return
    summary, first = serve_phase(a, gguf)
    print(f"\n{'bench serve --url':28} {'lorasync':>10} {'llama-srv':>10} {'ratio':>7} {'median':>7}", file=sys.stderr)
    for line, row in serve_rows(a, summary, first):
        print(line, file=sys.stderr)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
