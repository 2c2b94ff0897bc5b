"""`lorasync bench e2e` (time to accuracy against TRL), small: a tiny demo model made for the test,
one seed, two steps per system, two snapshots each, a few held-out problems. It runs lorasync's
trainer against a fleet, TRL's AsyncGRPOTrainer against the same kind of fleet and TRL's
GRPOTrainer with its own generation, for real; what it checks is that the rows, ratios, report,
curves and plot come out complete and finite, not how fast anything is (nothing here is timed).

Also: TRL's reward in bench/trl_e2e.py gives the verdicts lorasync's `math_boxed` gives (the same
completions through `lorasync grade`), so both sides train on the same reward."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import trl_e2e  # noqa: E402

BINARY = os.environ.get("LORASYNC_BINARY", str(ROOT / "build" / "release" / "apps" / "lorasync" / "lorasync"))


def test_reward_agrees_with_lorasync_math_boxed():
    rows = [
        ("the sum is \\boxed{12}", "12"), ("\\boxed{12.0}", "12"), ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{3} then \\boxed{4}", "4"), ("\\boxed{3} then \\boxed{4}", "3"), ("12", "12"), ("\\boxed{12", "12"),
        ("\\boxed{{12}}", "12"), ("\\boxed{-7}", "-7"), ("\\boxed{x}", "12"), ("", "1"), ("\\boxed{}", "0"),
        ("answer \\boxed{\\dfrac{3}{4}}", "\\frac34"), ("\\boxed{2,000}", "2000"), ("\\boxed{13}", "12"),
    ]
    ours = subprocess.run([BINARY, "grade"], input="".join(json.dumps({"completion": c, "answer": a}) + "\n" for c, a in rows),
                          capture_output=True, text=True, check=True)
    verdicts = [json.loads(line)["correct"] for line in ours.stdout.splitlines()]
    trl = trl_e2e.reward_math_boxed([[{"role": "assistant", "content": c}] for c, _ in rows], [a for _, a in rows])
    assert [bool(r) for r in trl] == verdicts, list(zip(rows, trl, verdicts))
    assert any(verdicts) and not all(verdicts)


def test_last_boxed_balances_braces():
    assert trl_e2e.last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert trl_e2e.last_boxed("\\boxed{1") is None
    assert trl_e2e.last_boxed("no box") is None


def run_bench(tmp_path, *args):
    return subprocess.run([BINARY, "bench", "e2e", *map(str, args)], capture_output=True, text=True, timeout=840,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_refuses_an_unknown_system(tmp_path):
    p = run_bench(tmp_path, "--systems", "lorasync,vllm", "--out", tmp_path / "out", "--demo-dir", tmp_path / "none")
    assert p.returncode == 2, p.stderr
    assert "vllm" in p.stderr and "trl-async" in p.stderr


def test_small_race_produces_every_row(tmp_path):
    out = tmp_path / "out"
    p = run_bench(tmp_path, "--demo-dir", tmp_path / "demo", "--model-steps", 40, "--seeds", 5, "--max-steps", 2,
                  "--save-steps", 1, "--budget-s", 300, "--eval-problems", 6, "--eval-samples", 1, "--target", 0.0,
                  "--out", out)
    assert p.returncode == 0, p.stderr[-6000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    systems = ["lorasync", "trl-async", "trl-sync"]
    for system in systems:
        mine = {r["metric"]: r for r in rows if r["config"]["system"] == system}
        assert set(mine) >= {"time_to_target_s", "final_accuracy", "s_per_step", "trained_tokens_per_s", "rollout_tokens_per_s"}, mine
        for r in mine.values():
            assert math.isfinite(r["value"]) and r["value"] >= 0, r
        assert mine["time_to_target_s"]["value"] > 0  # a trained snapshot, never the base model
        if system != "lorasync":  # the ratio: this system's time over lorasync's
            assert math.isfinite(mine["time_to_target_s"]["ratio"]) and mine["time_to_target_s"]["ratio"] > 0
    report = json.loads((out / "report.json").read_text())
    assert report["format_version"] == 1 and report["systems"] == systems
    assert [r["system"] for r in report["runs"]] == systems
    for run in report["runs"]:
        assert run["steps"] == 2, run
        curve = run["curve"]
        assert curve[0]["step"] == 0 and curve[0]["t"] == 0  # the base model
        assert [c["step"] for c in curve[1:]] == [1, 2], curve
        assert all(0 <= c["accuracy"] <= 1 for c in curve)
        assert all(b["t"] > a["t"] for a, b in zip(curve, curve[1:])), curve
        assert run["time_to_target_s"] == curve[1]["t"]
        assert run["peak_rss_mb"]["trainer"] > 10
        for key in ("wall_s", "trained_tokens_per_s", "rollout_tokens_per_s", "s_per_step"):
            assert run[key] is not None and math.isfinite(run[key]) and run[key] > 0, (key, run)
    for run in report["runs"][:2]:  # the two that use the fleet
        assert {"replica0", "replica1", "proxy"} <= set(run["peak_rss_mb"]), run
        assert 0 < run["fleet_busy_share"] <= 1, run
        assert run["wall_breakdown_s"]["trainer_compute"] > 0, run
    assert report["runs"][1]["sync_p50_s"] > 0  # TRL syncs when it starts; two steps are too few for lorasync's first
    assert report["runs"][2]["wall_breakdown_s"]["startup"] > 0
    svg = (out / "accuracy_vs_time.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") >= 3
    assert "| trl-sync |" in (out / "summary.md").read_text()
