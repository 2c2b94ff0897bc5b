"""`lorasync grade` against Math-Verify's own unit-test suite (issue 51, item 7).

Math-Verify's tests/ folder (its sdist, pinned like the package: python/requirements.txt; kept in
the wheelhouse by scripts/setup, never committed) holds (gold, prediction, expected verdict) cases
for a MATH verifier. math_verify_suite.py reads them with `ast`; each case that fits our input
form (math_verify_suite.EXCLUSIONS names the ones that do not) is graded as a bare prediction
(`{"prediction": pred, "answer": gold}`, grade_answer in src/reward/grade.h) and our verdict is
compared with the expected one. The deliberate disagreements (DELIBERATE below, each with its
reason in docs/grader.md) are counted apart; the test fails when agreement on the rest is under
FLOOR, or when a deliberate disagreement starts to agree (the list must then shrink).
"""
import json

from conftest import figure, lorasync
from math_verify_suite import EXCLUSIONS, load_cases, pinned_version

# Measured: 233/270 (86.3 %) before issue 51's fixes; 264/264 (100 %) after, the 6 deliberate
# disagreements apart. The goal of issue 51 is the floor.
FLOOR = 0.97

# Cases where we differ from the expected verdict on purpose, by "file::test[index]" (the index
# in the test's parametrize list) -> class. docs/grader.md gives each class's reason.
DELIBERATE = {
    # "Answer $\n 9 \n$" against 9: Math-Verify's LaTeX regex skips a math span with line breaks
    # inside its delimiters; the answer is 9.
    "tests/test_all.py::test_latex_notation[5]": "math_span_with_line_breaks",
    "tests/test_all.py::test_latex_notation[6]": "math_span_with_line_breaks",
    # Gold `x \in [-2,7]` against `-2 \le x \le 7`: the same set; Math-Verify refuses it unless
    # allow_set_relation_comp (it accepts the reverse order).
    "tests/test_all.py::test_set_rel_assymetry[3]": "relation_for_a_set",
    # A reference whose \boxed{ never closes, naming W(n) where the prediction names W(x).
    "tests/test_numina_cases.py::test_numina_cases[24]": "malformed_reference",
    # `\sum` with symbolic bounds (F_n recurrences): no computer algebra.
    "tests/test_yujianll.py::test_string_extraction[5]": "symbolic_sum",
    # `1 - 1/e` against `1 + 1/e`: different numbers; Math-Verify's expected verdict says equal.
    "tests/test_yujianll.py::test_string_extraction[9]": "expected_verdict_wrong",
}


def key(c):
    return f"{c['file']}::{c['test']}[{c['index']}]"


def test_math_verify_suite(tmp):
    cases = load_cases()
    kept = [c for c in cases if "excluded" not in c]
    excluded = {r: sum(c.get("excluded") == r for c in cases) for r in EXCLUSIONS}
    assert len(kept) >= 250, f"only {len(kept)} cases read from the sdist"
    unknown = set(DELIBERATE) - {key(c) for c in kept}
    assert not unknown, f"DELIBERATE names cases the suite does not have: {sorted(unknown)}"

    inp = tmp / "suite.jsonl"
    inp.write_text("".join(json.dumps({"prediction": c["pred"], "answer": c["gold"], "id": key(c)})
                           + "\n" for c in kept))
    p = lorasync("grade", "--input", inp, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    verdicts = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert len(verdicts) == len(kept)

    agree, counted, misses, now_agree = 0, 0, [], []
    for c, v in zip(kept, verdicts):
        ok = v["correct"] == c["expected"]
        if key(c) in DELIBERATE:
            if ok:
                now_agree.append(key(c))
            continue
        counted += 1
        agree += ok
        if not ok:
            misses.append((c, v))
    rate = agree / counted
    figure("math_verify_suite_agreement", round(rate, 4), agree=agree, counted=counted,
           deliberate=len(DELIBERATE), excluded=excluded, cases=len(cases),
           math_verify=pinned_version())
    for c, v in misses:
        print(json.dumps({"case": key(c), "expected": c["expected"], "ours": v["correct"],
                          "reason": v["reason"], "extracted": v["extracted"][:120],
                          "gold": c["gold"][:160], "pred": c["pred"][:160]}))
    assert not now_agree, f"deliberate disagreements that now agree (drop them): {now_agree}"
    assert rate >= FLOOR, f"agreement {agree}/{counted} = {rate:.4f} < {FLOOR}"
