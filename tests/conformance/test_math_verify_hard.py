"""`lorasync grade` against Math-Verify on the outputs early-RL policies write (issue 17).

The typical-case corpus is test_math_verify.py. This one rewrites the shared data's answers the
harder ways models write final answers, by family:
  box_sentence      a sentence inside the box, the answer in inline maths or prose
                    (`\\boxed{The value is $12$}`, `\\boxed{Final: the smallest $k$ is 7}`)
  decimal_comma     decimal commas and thousands separators of other locales (`3,75`, `12.500,25`,
                    `12\\,500`)
  units             units, currency and degrees glued to the number (`\\$12`, `12\\text{ cm}`, `12cm`,
                    `45^\\circ`, `12 dollars`)
  equation_forms    equations written another way (sides swapped, moved to one side, scaled)
  multi_box         one box per part against a gold listing all parts; parts joined by "and" / "or"
  relations_prose   inequalities with `\\geq`, `\\lt`, `<=`, `!=` inside prose in the box
  truncated_or_none no box at all (the answer only in the reasoning), or two contradicting boxes
  wrong_*           the same shapes holding a wrong answer
Both verifiers grade every row; agreement is printed per family and overall, and the test fails
under the floor. Disagreements we keep on purpose are listed in docs/grader.md.
"""
import json
import random
import re
from collections import defaultdict

from conftest import SHARED, figure, lorasync
from test_math_verify import golds, math_verify_grade

SAMPLE = 400
# Floors: the measured agreement at the time of writing, minus a margin (a regression fails, an
# improvement is reported). The goal of issue 17 (>= 97 %) is met against Math-Verify configured as
# RL trainers call it (TRL's accuracy_reward); against its default configuration the difference
# is the rows without any box, which the recipe's rule scores 0 (docs/grader.md).
RL_FLOOR = 0.97       # measured 0.982 (issue 51: decimal commas read as decimals)
DEFAULT_FLOOR = 0.92  # measured 0.941
# Disagreement classes kept on purpose (Math-Verify is wrong there; docs/grader.md).
KEPT = ("no_box", "thin_space_thousands", "inequality_for_interval", "sentence_times_zero",
        "decimal_comma")

INT = re.compile(r"^-?\d+$")
DEC = re.compile(r"^-?\d+\.\d+$")
FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(\d+)\}$")
# A box holding one number with a decimal comma ("3,75", "12.500,25"): read as a decimal since
# issue 51 (Math-Verify's own test suite expects it; its LaTeX extraction reads a list).
DECIMAL_COMMA = re.compile(r"\\boxed\{-?\d{1,3}(?:\.\d{3})*(?:\{,\}|,)\d+\}|\\boxed\{-?\d+(?:\{,\}|,)\d+\}")
LINE = re.compile(r"^y\s*=\s*(-?\d*)x\s*([+-])\s*(\d+)$")


def math_verify_rl(gold, completion):
    """Math-Verify configured as RL trainers use it: TRL's `accuracy_reward` (trl/rewards), i.e.
    LaTeX extraction only, boxed answers first, no unanchored expressions from the prose, units
    normalised, first match."""
    from math_verify import LatexExtractionConfig, parse, verify
    from latex2sympy2_extended import NormalizationConfig
    try:
        g = parse(f"${gold}$")
        if not g:
            return False
        p = parse(completion, extraction_config=[LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
            try_extract_without_anchor=False)], extraction_mode="first_match")
        return bool(verify(g, p))
    except Exception:
        return False


def wrong_int(n, rng):
    return n + rng.choice([-3, -1, 1, 2, 7])


def rows_for(gold, rng, others):
    """(family, completion, expected) for one gold."""
    out = []
    lead = "Let me work through this carefully.\n\nAfter simplifying, "
    out.append(("box_sentence", lead + f"\\boxed{{The value is ${gold}$}}", True))
    out.append(("box_sentence", lead + f"the answer is \\boxed{{\\text{{Final: }} {gold}}}.", True))
    other = rng.choice(others)
    if other != gold:
        out.append(("wrong_box_sentence", lead + f"\\boxed{{The value is ${other}$}}", False))
    if INT.match(gold):
        n = int(gold)
        out += [("box_sentence", lead + f"\\boxed{{Final: the smallest $k$ is {n}}}", True),
                ("units", f"So the total cost is \\boxed{{\\${n}}}.", True),
                ("units", f"The length is \\boxed{{{n}\\text{{ cm}}}}.", True),
                ("units", f"The length is \\boxed{{{n} \\mathrm{{cm}}}}.", True),
                ("units", f"The angle is \\boxed{{{n}^\\circ}}.", True),
                ("units", f"Therefore \\boxed{{{n}\\text{{ dollars}}}}", True),
                ("wrong_units", f"So the total cost is \\boxed{{\\${wrong_int(n, rng)}}}.", False)]
        if abs(n) >= 1000:
            out += [("decimal_comma", f"Hence \\boxed{{{n:,}}}".replace(",", "\\,"), True),
                    ("decimal_comma", f"Hence \\boxed{{{n:,}}}".replace(",", "{,}"), True),
                    ("decimal_comma", f"Hence \\boxed{{{n:,}}}".replace(",", "."), True)]
        m = wrong_int(n, rng)
        out += [("multi_box", f"The first part gives \\boxed{{{n}}} and we check it again: \\boxed{{{n}}}.", True),
                ("truncated_or_none", f"We find that the answer is {n}, as computed above.", False),
                ("truncated_or_none", f"Two candidates: \\boxed{{{n}}} or maybe \\boxed{{{m}}}", False),
                ("relations_prose", f"\\boxed{{x = {n}}}", True),
                ("wrong_relations_prose", f"\\boxed{{x = {m}}}", False)]
    if DEC.match(gold) and not gold.startswith("-"):
        whole, frac = gold.split(".")
        out += [("decimal_comma", f"Thus \\boxed{{{whole},{frac}}}", True),
                ("decimal_comma", f"Thus \\boxed{{{whole}{{,}}{frac}}}", True),
                ("wrong_decimal_comma", f"Thus \\boxed{{{whole},{frac}1}}", False)]
        if len(whole) >= 4:
            grouped = f"{int(whole):,}".replace(",", ".")
            out.append(("decimal_comma", f"Thus \\boxed{{{grouped},{frac}}}", True))
    m = FRAC.match(gold)
    if m:
        p, q = m.groups()
        out += [("box_sentence", lead + f"\\boxed{{\\text{{the probability is }} \\frac{{{p}}}{{{q}}}}}", True),
                ("units", f"The ratio is \\boxed{{\\frac{{{p}}}{{{q}}}\\text{{ units}}}}", True)]
    lm = LINE.match(gold.replace(" ", ""))
    if lm:
        a, sign, b = lm.groups()
        a = a or "1"
        a = "-1" if a == "-" else a
        s = 1 if sign == "+" else -1
        ai, bi = int(a), s * int(b)
        out += [("equation_forms", f"\\boxed{{{ai}x - y + ({bi}) = 0}}", True),
                ("equation_forms", f"\\boxed{{2y = {2 * ai}x + ({2 * bi})}}", True),
                ("wrong_equation_forms", f"\\boxed{{2y = {2 * ai}x + ({2 * bi + 1})}}", False)]
    return out


def sampled_rows(rng, all_golds, n=250):
    """Sampled-style completions: reasoning with inline maths, then the final box (the gold, or
    another row's answer), some after a </think>."""
    words = ("we", "note", "that", "the", "sum", "is", "then", "so", "hence", "compute", "value",
             "of", "both", "sides", "and", "check", "it")
    rows = []
    for g in rng.sample(all_golds, n):
        body = []
        for _ in range(rng.randint(3, 8)):
            body.append(" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) +
                        f" ${rng.randint(2, 99)} + {rng.randint(2, 99)} = {rng.randint(4, 198)}$.")
        text = "\n".join(body)
        if rng.random() < 0.3:
            text = "<think>" + text + "</think>\n"
        other = rng.choice(all_golds)
        if rng.random() < 0.6 or other == g:
            rows.append(("sampled", g, text + f"\nTherefore the answer is $\\boxed{{{g}}}$.", True))
        else:
            rows.append(("wrong_sampled", g, text + f"\nTherefore the answer is $\\boxed{{{other}}}$.", False))
    return rows


def kept_class(r, ours, mv):
    """The documented disagreement class a row falls in, or None."""
    c = r["completion"]
    if ours or "\\boxed" in c:
        if ours and "\\," in c and re.search(r"\d\\,\d", c):
            return "thin_space_thousands"
        if ours and re.search(r"\\boxed\{x \\geq? ", c) and r["gold"].startswith("["):
            return "inequality_for_interval"
        if mv and not ours and r["gold"].strip() == "0":
            return "sentence_times_zero"
        if ours and not mv and DEC.match(r["gold"]) and DECIMAL_COMMA.search(c):
            return "decimal_comma"
        return None
    return "no_box" if mv else None


def synthetic_rows(rng):
    """Shapes the shared data holds too rarely: lists, relations, equations."""
    rows = []
    for _ in range(60):
        a, b = sorted(rng.sample(range(-9, 20), 2))
        gold = f"{a}, {b}"
        rows += [("multi_box", gold, f"For part (a) we get \\boxed{{{a}}}, and for part (b) \\boxed{{{b}}}.", True),
                 ("multi_box", gold, f"\\boxed{{x = {a} \\text{{ or }} x = {b}}}", True),
                 ("multi_box", gold, f"\\boxed{{{a} \\text{{ and }} {b}}}", True),
                 ("multi_box", gold, f"\\boxed{{{a}; {b}}}", True),
                 ("wrong_multi_box", gold, f"For part (a) we get \\boxed{{{a}}}, and for part (b) \\boxed{{{b + 1}}}.", False)]
        c = rng.randint(-9, 9)
        rows += [("relations_prose", f"x \\ge {c}", f"\\boxed{{\\text{{so }} x \\geq {c} \\text{{ holds}}}}", True),
                 ("relations_prose", f"x \\ge {c}", f"\\boxed{{x >= {c}}}", True),
                 ("relations_prose", f"x < {c}", f"\\boxed{{x \\lt {c}}}", True),
                 ("relations_prose", f"x < {c}", f"\\boxed{{\\text{{we need }} x < {c}}}", True),
                 ("relations_prose", f"x \\le {c}", f"\\boxed{{x <= {c}}}", True),
                 ("relations_prose", f"x \\neq {c}", f"\\boxed{{x != {c}}}", True),
                 ("relations_prose", f"[{c}, \\infty)", f"\\boxed{{x \\geq {c}}}", True),
                 ("wrong_relations_prose", f"x \\ge {c}", f"\\boxed{{x \\geq {c + 1}}}", False),
                 ("wrong_relations_prose", f"x < {c}", f"\\boxed{{x > {c}}}", False)]
        k, m = rng.randint(2, 6), rng.randint(1, 9)
        rows += [("equation_forms", f"y = {k}x + {m}", f"\\boxed{{{k}x - y + {m} = 0}}", True),
                 ("equation_forms", f"y = {k}x + {m}", f"\\boxed{{{k}x + {m} = y}}", True),
                 ("equation_forms", f"y = {k}x + {m}", f"\\boxed{{2y = {2 * k}x + {2 * m}}}", True),
                 ("equation_forms", f"x^2 + y^2 = {m * m}", f"\\boxed{{x^2 + y^2 - {m * m} = 0}}", True),
                 ("wrong_equation_forms", f"y = {k}x + {m}", f"\\boxed{{y = {k}x + {m + 1}}}", False),
                 ("wrong_equation_forms", f"y = {k}x + {m}", f"\\boxed{{{k}x - y - {m} = 0}}", False)]
    return rows


def build_rows(seed=17):
    rng = random.Random(seed)
    all_golds = golds()
    rows = []
    for g in rng.sample(all_golds, SAMPLE):
        for fam, text, expected in rows_for(g, rng, all_golds):
            rows.append({"family": fam, "gold": g, "completion": text, "expected": expected})
    for fam, g, text, expected in synthetic_rows(rng) + sampled_rows(rng, all_golds):
        rows.append({"family": fam, "gold": g, "completion": text, "expected": expected})
    return rows


def test_hard_outputs_agree_with_math_verify(tmp):
    rows = build_rows()
    inp = tmp / "rows.jsonl"
    inp.write_text("".join(json.dumps({"completion": r["completion"], "answer": r["gold"]}) + "\n" for r in rows))
    p = lorasync("grade", "--input", inp, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    ours = [json.loads(line)["correct"] for line in p.stdout.splitlines() if line.strip()]
    assert len(ours) == len(rows)
    results = {}
    for config, judge in (("rl", math_verify_rl), ("default", math_verify_grade)):
        per = defaultdict(lambda: [0, 0])
        kept = defaultdict(int)
        disagreements = []
        for r, o in zip(rows, ours):
            mv = r[config] = judge(r["gold"], r["completion"])
            per[r["family"]][1] += 1
            if o == mv:
                per[r["family"]][0] += 1
            else:
                k = kept_class(r, o, mv)
                kept[k or "other"] += 1
                disagreements.append({**r, "ours": o, "math_verify": mv, "class": k})
        agree = len(rows) - len(disagreements)
        results[config] = agree / len(rows)
        for fam, (a, n) in sorted(per.items()):
            figure(f"math_verify_{config}_hard_agreement_{fam}", round(a / n, 4), rows=n)
        figure(f"math_verify_{config}_hard_agreement_overall", round(agree / len(rows), 4), rows=len(rows),
               disagreements_by_class=dict(kept),
               agreement_outside_kept_classes=round(1 - kept["other"] / len(rows), 4),
               ours_correct=sum(ours), expected_correct=sum(r["expected"] for r in rows))
        for r in [d for d in disagreements if d["class"] is None][:20]:
            print(json.dumps({k: r[k] for k in ("family", "gold", "completion", "ours", "math_verify")}))
    # Strictness that matters for RL, by construction of the rows: never a reward for a wrong
    # answer, an answer only in the reasoning, or a self-contradicting pair of boxes (unless
    # Math-Verify too finds the "wrong" answer equal: another row's answer can be equivalent).
    false_positives = [r for r, o in zip(rows, ours) if o and not r["expected"] and not r["rl"] and not r["default"]]
    assert not false_positives, false_positives[:5]
    assert results["rl"] >= RL_FLOOR, f"agreement {results['rl']:.4f} < {RL_FLOOR} (RL configuration)"
    assert results["default"] >= DEFAULT_FLOOR, f"agreement {results['default']:.4f} < {DEFAULT_FLOOR}"
