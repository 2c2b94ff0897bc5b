#!/usr/bin/env python3
"""bench/ab_compare.py: the same `lorasync bench` commands run by two builds in one run, the order
swapped every repeat (A B, B A, A B ...), and a table of B/A ratios: the best of the repeats of each
build, and the median of the repeats' own B/A ratios.

For changes that move the whole build (a libtorch upgrade, compiler flags, allocator): one binary
is the baseline, the other the change, measured on the same machine within minutes of each other.

  python3 bench/ab_compare.py --a OLD/lorasync --b build/release/apps/lorasync/lorasync \\
      [--repeats 2] [--out results.json] [--suite cpu]

Suites: `cpu` = bench gemm (small shapes), bench forward (small: prefill, decode at batch
1/8/64), bench train (small, rows of 4,096); `proxy` = bench proxy (32/128/384 concurrent).
Metrics where lower is better (times: s, ms, us; memory: B, MiB, GiB) keep the lowest of the
repeats and are reported as A/B, so that every ratio > 1 means B is better.
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
    # The proxy in front of stub replicas: CPU per request, throughput, added latency.
    "proxy": [
        ["bench", "proxy"],
    ],
}
LOWER_UNITS = ("s", "ms", "us", "B", "MiB", "GiB")  # times and memory: lower is better, reported as A/B
IGNORED = ("threads", "device", "params")


def run(binary, args):
    """Rows (bench, metric, config, value, unit) of one `lorasync bench` invocation."""
    p = subprocess.run([binary, *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{binary} {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    rows = []
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            j = json.loads(line)
            cfg = {k: v for k, v in j.get("config", {}).items() if k not in IGNORED}
            rows.append((j["bench"], j["metric"], cfg, j["value"], j.get("unit", "")))
    return rows


def same(r, q):
    """Same measurement: bench, metric, and every configuration key both sides report."""
    return r[0] == q[0] and r[1] == q[1] and all(r[2][k] == q[2][k] for k in r[2].keys() & q[2].keys())


def keep_best(best, row):
    for i, b in enumerate(best):
        if same(b, row):
            lower = row[4] in LOWER_UNITS
            if (row[3] < b[3]) if lower else (row[3] > b[3]):
                best[i] = row
            return
    best.append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="baseline binary")
    ap.add_argument("--b", required=True, help="changed binary")
    ap.add_argument("--suite", default="cpu", choices=sorted(SUITES))
    ap.add_argument("--only", help="run only the suite's commands containing this word (e.g. train)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    best = {"a": [], "b": []}
    repeats = []  # per command and repeat: {"a": rows, "b": rows}
    for args in SUITES[a.suite]:
        if a.only and a.only not in args:
            continue
        for r in range(a.repeats):
            sides = (("a", a.a), ("b", a.b)) if r % 2 == 0 else (("b", a.b), ("a", a.a))
            rows = {}
            for side, binary in sides:
                rows[side] = run(binary, args)
                for row in rows[side]:
                    keep_best(best[side], row)
            repeats.append(rows)

    def b_vs_a(va, vb, unit):
        return (va / vb if unit in LOWER_UNITS else vb / va) if va and vb else float("nan")

    def median(xs):
        xs = sorted(x for x in xs if x == x)
        n = len(xs)
        return float("nan") if n == 0 else (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)

    out = []
    print(f"{'measurement':62s} {'A':>11s} {'B':>11s} {'B vs A':>8s} {'median':>8s}")
    for ra in best["a"]:
        rb = next((q for q in best["b"] if same(ra, q)), None)
        if rb is None:
            continue
        va, vb, unit = ra[3], rb[3], ra[4]
        ratio = b_vs_a(va, vb, unit)
        per_repeat = []
        for rows in repeats:
            qa = next((q for q in rows["a"] if same(ra, q)), None)
            qb = next((q for q in rows["b"] if same(ra, q)), None)
            if qa is not None and qb is not None:
                per_repeat.append(b_vs_a(qa[3], qb[3], unit))
        name = " ".join([ra[0], ra[1]] + [f"{k}={v}" for k, v in sorted(ra[2].items())
                                          if k in ("batch", "m", "n", "k", "preset", "row_tokens")])
        out.append({"bench": ra[0], "metric": ra[1], "config": ra[2], "unit": unit, "a": va, "b": vb,
                    "b_vs_a": ratio, "b_vs_a_per_repeat": per_repeat, "b_vs_a_median": median(per_repeat)})
        print(f"{name[:62]:62s} {va:11.2f} {vb:11.2f} {ratio:7.2f}x {median(per_repeat):7.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"a": a.a, "b": a.b, "suite": a.suite, "repeats": a.repeats, "rows": out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
