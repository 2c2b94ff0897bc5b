"""Math-Verify's own unit-test cases, read from its pinned sdist (issue 51, item 7).

Math-Verify's tests/ folder (in the sdist on PyPI, not in the wheel) holds (gold, prediction,
expected verdict) cases in pytest parametrize lists and in literal calls. This module opens the
sdist that scripts/setup keeps in the wheelhouse (never committed, never downloaded here), parses
each test file with `ast` (nothing of it is imported or run) and returns the cases with the
configuration each one is checked under.

  .venv/bin/python tests/conformance/math_verify_suite.py [--sdist PATH] [--jsonl OUT]

prints the counts (and with --jsonl writes every case as a JSON line).

A case "fits our input form" when it is a (gold string, prediction string, verdict) triple checked
with Math-Verify's default comparison settings (float_rounding=6, strict, no set-relation
comparison) and its extraction of LaTeX and/or expressions; the others are excluded with a
named, counted reason (EXCLUSIONS).
"""
import argparse
import ast
import json
import math
import os
import re
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Reasons a case is left out of the agreement (not a verdict we disagree with: a setting we do
# not model). Every excluded case carries one of these names.
EXCLUSIONS = {
    "float_rounding": "checked with float_rounding below 5 (precision=N): accepting 0.33 for 1/3 "
                      "is a setting we do not offer",
    "not_strict": "checked with strict=False (f(x) equal to f(y)): a setting we do not offer",
    "set_relation_comp": "checked with allow_set_relation_comp=True: a setting we do not offer "
                         "(we always compare a relation with the set it defines)",
    "string_extraction": "StringExtractionConfig (a multiple-choice letter extractor): not a "
                         "(gold, prediction) pair",
}


def pinned_version():
    for line in (ROOT / "python/requirements.txt").read_text().splitlines():
        m = re.match(r"^math-verify==(\S+)", line.strip())
        if m:
            return m.group(1)
    raise RuntimeError("python/requirements.txt does not pin math-verify")


def wheelhouse():
    return Path(os.environ.get("LORASYNC_WHEELHOUSE",
                               Path.home() / ".cache/lorasync/wheels"))


def sdist_path(version=None):
    version = version or pinned_version()
    return wheelhouse() / f"math_verify-{version}.tar.gz"


def _value(node, params):
    """A literal (or a parameter name bound in `params`) as a Python value."""
    if isinstance(node, ast.Name) and node.id in params:
        return params[node.id]
    try:
        return ast.literal_eval(node)
    except ValueError:
        # f"{math.sqrt(17):.15f}" in test_float_precision: an f-string over `math` only.
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if names <= {"math"} and isinstance(node, ast.JoinedStr):
            return eval(compile(ast.Expression(node), "<case>", "eval"),
                        {"__builtins__": {}, "math": math})
        raise


def _literal_or_none(node):
    try:
        return _value(node, {})
    except ValueError:
        return None  # StringExtractionConfig(...) objects of test_string_extraction


def _call_name(call):
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _config_of(call, params):
    """The settings of one compare_strings(...) / verify(parse(..), parse(..)) call."""
    name = _call_name(call)
    if name == "compare_strings":
        cfg = {"helper": "compare_strings", "match_types": ["latex", "expr"], "precision": 6,
               "strict": True, "allow_set_relation_comp": False}
        keys = ["gold", "pred", "match_types", "precision", "strict", "allow_set_relation_comp"]
        args = {k: a for k, a in zip(keys, call.args)}
        args.update({k.arg: k.value for k in call.keywords})
        for k in keys[2:]:
            if k in args:
                cfg[k] = _value(args[k], params)
        return cfg, args["gold"], args["pred"]
    if name == "verify" and all(isinstance(a, ast.Call) and _call_name(a) == "parse"
                                for a in call.args[:2]) and not call.keywords:
        return ({"helper": "verify(parse, parse)", "match_types": ["latex", "expr"], "precision": 6,
                 "strict": True, "allow_set_relation_comp": False},
                call.args[0].args[0], call.args[1].args[0])
    return None


def _checked_calls(fn):
    """(call, expected-node or None) for each `assert <call> == <expected>` / `assert int(<call>)
    == <expected>` / `assert [not] <call>` in a test function."""
    out = []
    for st in ast.walk(fn):
        if not isinstance(st, ast.Assert):
            continue
        t, expected, negate = st.test, None, False
        if isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
            t, negate = t.operand, True
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            t, expected = t.left, t.comparators[0]
        if isinstance(t, ast.Call) and _call_name(t) in ("int", "bool") and t.args:
            t = t.args[0]
        if isinstance(t, ast.Call):
            out.append((t, expected, negate))
    return out


def _parametrize(fn):
    for d in fn.decorator_list:
        if isinstance(d, ast.Call) and _call_name(d) == "parametrize":
            names = [n.strip() for n in ast.literal_eval(d.args[0]).split(",")]
            return names, d.args[1].elts
    return None


def cases_from_source(filename, source):
    """Every (gold, pred, expected) case of one test file, with its settings and exclusion."""
    tree = ast.parse(source, filename)
    out = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
            continue
        uses_string_config = any(isinstance(n, ast.Name) and n.id == "StringExtractionConfig"
                                 for n in ast.walk(fn))
        par = _parametrize(fn)
        rows = []
        if par:
            names, elts = par
            for k, e in enumerate(elts):
                vals = [_literal_or_none(v) for v in e.elts] if isinstance(e, ast.Tuple) else None
                rows.append((k, dict(zip(names, vals)) if vals else {}))
        else:
            rows.append((None, {}))
        for k, params in rows:
            if uses_string_config:
                out.append({"file": filename, "test": fn.name, "index": k,
                            "excluded": "string_extraction"})
                continue
            for call, expected_node, negate in _checked_calls(fn):
                got = _config_of(call, params)
                if not got:
                    continue
                cfg, gold_node, pred_node = got
                try:
                    gold, pred = _value(gold_node, params), _value(pred_node, params)
                except ValueError:
                    continue  # sympy objects (test_precision's sympy_expr_eq): not strings
                if not (isinstance(gold, str) and isinstance(pred, str)):
                    continue
                if expected_node is None:
                    expected = not negate
                else:
                    expected = bool(_value(expected_node, params))
                    if negate:
                        expected = not expected
                case = {"file": filename, "test": fn.name, "index": k, "gold": gold, "pred": pred,
                        "expected": expected, **cfg}
                if cfg["precision"] < 5:
                    case["excluded"] = "float_rounding"
                elif not cfg["strict"]:
                    case["excluded"] = "not_strict"
                elif cfg["allow_set_relation_comp"]:
                    case["excluded"] = "set_relation_comp"
                out.append(case)
    return out


def load_cases(sdist=None):
    """Every case of the sdist's tests/*.py, in file order. Raises FileNotFoundError (with the
    command that fetches it) when the sdist is not in the wheelhouse."""
    path = Path(sdist) if sdist else sdist_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: scripts/setup keeps Math-Verify's sdist there "
            f"(pip download --no-deps --no-binary=:all: math-verify=={pinned_version()})")
    cases = []
    with tarfile.open(path) as tar:
        members = sorted((m for m in tar.getmembers()
                          if re.fullmatch(r"[^/]+/tests/test_[^/]+\.py", m.name)),
                         key=lambda m: m.name)
        for m in members:
            src = tar.extractfile(m).read().decode("utf-8")
            cases += cases_from_source(m.name.split("/", 1)[1], src)
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist")
    ap.add_argument("--jsonl")
    args = ap.parse_args()
    cases = load_cases(args.sdist)
    kept = [c for c in cases if "excluded" not in c]
    print(f"{len(cases)} cases, {len(kept)} fit, excluded:",
          json.dumps({r: sum(c.get("excluded") == r for c in cases) for r in EXCLUSIONS}))
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for c in cases:
                f.write(json.dumps(c) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
