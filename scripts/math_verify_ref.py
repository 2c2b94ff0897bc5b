#!/usr/bin/env python3
"""scripts/math_verify_ref.py: Hugging Face Math-Verify (math-verify from PyPI, the project's .venv)
grades a JSONL of {"completion", "answer"} rows, for `lorasync bench grade --math-verify`.

  .venv/bin/python scripts/math_verify_ref.py --config rl|default --input rows.jsonl --output v.jsonl

--config rl:      as RL trainers call it (TRL's accuracy_reward): LaTeX extraction only, boxed
                  answers first, nothing unanchored from the prose, units normalised, first match.
--config default: parse(completion) with Math-Verify's default extraction (LaTeX and expressions).
The gold is parsed as `$answer$`. Output rows {"correct": bool}; one summary JSON object on stdout:
{"version", "config", "n", "grade_s"} (grade_s: the parse + verify calls only, one row at a time).
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
    out, spent = [], 0.0
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
        out.append(ok)
    with open(args.output, "w") as f:
        for ok in out:
            f.write(json.dumps({"correct": ok}) + "\n")
    try:
        from importlib.metadata import version as dist_version
        version = dist_version("math-verify")
    except Exception:
        version = getattr(math_verify, "__version__", "unknown")
    print(json.dumps({"version": version, "config": args.config, "n": len(rows), "grade_s": spent}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
