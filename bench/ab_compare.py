#!/usr/bin/env python3
"""bench/ab_compare.py: the same `lorasync bench` commands run by two builds in one run, A/B/A/B
alternated, and a table of B/A ratios (the best of the repeats of each build).

For changes that move the whole build (a libtorch upgrade, compiler flags, allocator): one binary
is the baseline, the other the change, measured on the same machine within minutes of each other.

  python3 bench/ab_compare.py --a OLD/lorasync --b build/release/apps/lorasync/lorasync \\
      [--repeats 2] [--out results.json] [--suite cpu]

Suites: `cpu` = bench gemm (small shapes), bench forward (small: prefill, decode at batch
1/8/64), bench train (small, rows of 4,096). Metrics where lower is better (times) are
reported as A/B so that every ratio > 1 means B is faster.
"""
import argparse
import json
import subprocess
import sys

SUITES = {
    "cpu": [
        ["bench", "gemm", "--preset", "small", "--dtypes", "float32", "--threads", "2"],
        ["bench", "forward", "--presets", "small", "--threads", "2"],
        ["bench", "train", "--preset", "small", "--threads", "2", "--steps", "2"],
    ],
}
LOWER_IS_BETTER = ("_ms", "_s", "seconds")


def key_of(j):
    c = {k: v for k, v in j.get("config", {}).items() if k not in ("threads", "device", "params")}
    return " ".join([j["bench"], j["metric"]] + [f"{k}={c[k]}" for k in sorted(c)])


def run(binary, args):
    p = subprocess.run([binary, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            j = json.loads(line)
            out[key_of(j)] = (j["value"], j.get("unit", ""))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="baseline binary")
    ap.add_argument("--b", required=True, help="changed binary")
    ap.add_argument("--suite", default="cpu", choices=sorted(SUITES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    best = {"a": {}, "b": {}}
    for args in SUITES[a.suite]:
        for _ in range(a.repeats):
            for side, binary in (("a", a.a), ("b", a.b)):
                for k, (v, unit) in run(binary, args).items():
                    lower = k.split()[1].endswith(LOWER_IS_BETTER) or unit in ("s", "ms")
                    cur = best[side].get(k)
                    if cur is None or (v < cur[0] if lower else v > cur[0]):
                        best[side][k] = (v, unit)
    rows = []
    print(f"{'metric':60s} {'A':>12s} {'B':>12s} {'B vs A':>8s}")
    for k in best["a"]:
        if k not in best["b"]:
            continue
        (va, unit), (vb, _) = best["a"][k], best["b"][k]
        lower = k.split()[1].endswith(LOWER_IS_BETTER) or unit in ("s", "ms")
        ratio = (va / vb if lower else vb / va) if va and vb else float("nan")
        rows.append({"metric": k, "unit": unit, "a": va, "b": vb, "b_vs_a": ratio})
        print(f"{k[:60]:60s} {va:12.2f} {vb:12.2f} {ratio:7.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"a": a.a, "b": a.b, "suite": a.suite, "repeats": a.repeats, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
