#!/usr/bin/env python3
"""A lorasync command reward: unit tests of the Python code a completion writes.

Configure it in the trainer's TOML (docs/trainer.md, "External rewards"):

    [grpo]
    reward_funcs = ["unit_tests"]
    reward_weights = [1.0]

    [rewards.unit_tests]
    kind = "command"
    command = ["python3", "examples/rewards/python_unit_tests.py", "--test-timeout", "2"]
    workers = 4
    timeout_s = 10

Protocol: one JSON line in per completion ({"completion", "references", ...}), one line out
({"reward": r}). The candidate is the completion's last ```python block (the whole completion when
it has none); each entry of `references` (the dataset row's answer field: a string or a list) is
one test, typically `assert` statements calling the function. Each test runs as a fresh
`python3 -I -S` process in an empty temporary directory, killed with its process group after
--test-timeout seconds; the reward is the share of tests that exit 0. The lorasync worker that runs
this script is already sandboxed (no network namespace, rlimits), and so is every test it starts.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.S)


def candidate(text):
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def passes(code, test, timeout):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "candidate_test.py")
        with open(path, "w") as f:
            f.write(code + "\n\n" + test + "\n")
        p = subprocess.Popen([sys.executable, "-I", "-S", path], cwd=d, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            return p.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--test-timeout", type=float, default=2.0)
    args = ap.parse_args()
    for line in sys.stdin:
        req = json.loads(line)
        tests = req.get("references") or []
        if isinstance(tests, str):
            tests = [tests]
        code = candidate(req.get("completion", ""))
        passed = sum(passes(code, t, args.test_timeout) for t in tests)
        print(json.dumps({"reward": passed / len(tests) if tests else 0.0}), flush=True)


if __name__ == "__main__":
    main()
