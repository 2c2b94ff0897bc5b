#!/usr/bin/env python3
"""scripts/math_verify_ref.py: Hugging Face Math-Verify (math-verify from PyPI, the project's .venv)
grades a JSONL of {"completion", "answer"} rows, for `lorasync bench grade --math-verify`.

  .venv/bin/python scripts/math_verify_ref.py --config rl|default --input rows.jsonl --output v.jsonl [--passes P]

--config rl:      as RL trainers call it (TRL's accuracy_reward): LaTeX extraction only, boxed
                  answers first, nothing unanchored from the prose, units normalised, first match.
--config default: parse(completion) with Math-Verify's default extraction (LaTeX and expressions).
The gold is parsed as `$answer$`. Output rows {"correct": bool}; one summary JSON object on stdout:
{"version", "config", "n", "passes", "grade_s", "grade_s_per_pass"} (the parse + verify calls only,
one row at a time; with --passes P the rows are graded P times in a row, the verdicts are the first
pass's, and grade_s is the best pass's, as `bench grade` times its own passes over the same rows).
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=["rl", "default"], default="rl")
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--passes", type=int, default=1, help="timed passes over the rows (grade_s: the best)")
    args = ap.parse_args()
    try:
        import math_verify
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as e:
        sys.stderr.write(f"math_verify_ref: {e} (run scripts/setup)\n")
        return 2
    rl_config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                       boxed_match_priority=0, try_extract_without_anchor=False)]
    rows = [json.loads(l) for l in open(args.input) if l.strip()]

    def grade_pass():
        verdicts, spent = [], 0.0
        for r in rows:
            gold = r["answer"] if isinstance(r["answer"], str) else json.dumps(r["answer"])
            t0 = time.perf_counter()
            try:
                g = parse(f"${gold}$")
                if args.config == "rl":
                    p = parse(r["completion"], extraction_config=rl_config, extraction_mode="first_match")
                else:
                    p = parse(r["completion"])
                ok = bool(g) and bool(verify(g, p))
            except Exception:
                ok = False
            spent += time.perf_counter() - t0
            verdicts.append(ok)
        return verdicts, spent

    out, per_pass = None, []
    for _ in range(max(1, args.passes)):
        verdicts, spent = grade_pass()
        out = verdicts if out is None else out
        per_pass.append(spent)
    with open(args.output, "w") as f:
        for ok in out:
            f.write(json.dumps({"correct": ok}) + "\n")
    try:
        from importlib.metadata import version as dist_version
        version = dist_version("math-verify")
    except Exception:
        version = getattr(math_verify, "__version__", "unknown")
    print(json.dumps({"version": version, "config": args.config, "n": len(rows), "passes": len(per_pass),
                      "grade_s": min(per_pass), "grade_s_per_pass": per_pass}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
