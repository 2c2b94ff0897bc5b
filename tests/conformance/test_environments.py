"""The environment protocol v1 (docs/environments.md), worker side: python/lorasync_env's loop and
adapters driven as subprocesses over stdin/stdout, their rewards against the libraries' own
scorers (reasoning-gym's score_answer, verifiers' MathRubric), plus the worked example. Hostile
workers are tested against the trainer's own pool in tests/unit/rl/episode_test.cpp."""

import asyncio
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
sys.path.insert(0, str(ROOT / "python"))

from lorasync_env import Environment, Session, handle  # noqa: E402


class Worker:
    def __init__(self, *argv, timeout=60):
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        self.err = tempfile.TemporaryFile()  # a file, not a pipe: a chatty library must not block
        self.p = subprocess.Popen([PY, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, env=env, cwd=ROOT)
        self.timeout = timeout
        self.next_id = 100

    def line(self, text):
        self.p.stdin.write(text.encode() + b"\n")
        self.p.stdin.flush()
        r, _, _ = select.select([self.p.stdout], [], [], self.timeout)
        assert r, "worker did not answer in time"
        out = self.p.stdout.readline()
        assert out.endswith(b"\n"), (out, self.stderr())
        return json.loads(out)

    def request(self, **fields):
        self.next_id += 1
        req = {"lorasync_env": 1, "id": self.next_id, **fields}
        ans = self.line(json.dumps(req))
        assert ans["id"] == self.next_id
        return ans

    def reset(self, index, seed=0, **row):
        return self.request(op="reset", row={"index": index, "problem": "", "answers": [], **row}, seed=seed)

    def step(self, text, token_ids=(1, 2, 3), finish_reason="stop"):
        return self.request(op="step", action={"text": text, "token_ids": list(token_ids),
                                               "finish_reason": finish_reason})

    def stderr(self):
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def close(self):
        self.p.stdin.close()
        rc = self.p.wait(timeout=30)
        self.p.stdout.close()
        self.err.close()
        return rc


def check_obs(ans):
    assert set(ans) >= {"id", "observation", "done"}, ans
    obs = ans["observation"]
    assert list(obs) == ["messages"]
    for m in obs["messages"]:
        assert set(m) == {"role", "content"} and m["role"] in ("system", "user", "tool")
        assert isinstance(m["content"], str)
    return obs["messages"]


def check_protocol_errors(w):
    ans = w.line(json.dumps({"lorasync_env": 2, "id": 5, "op": "reset", "row": {}, "seed": 0}))
    assert ans["id"] == 5 and "supported: 1" in ans["error"]
    ans = w.line(json.dumps({"lorasync_env": 1, "id": 6, "op": "teleport"}))
    assert ans["id"] == 6 and "reset" in ans["error"] and "step" in ans["error"]


# --- protocol.py -------------------------------------------------------------------------------

class Flaky(Environment):
    def reset(self, row, seed):
        if row.get("boom"):
            raise KeyError("boom")
        return "hello", {"seed": seed}

    def step(self, action):
        if action["text"] == "nan":
            return None, float("nan"), True, {}
        if action["text"] == "raise":
            raise RuntimeError("env failed")
        return None, 2, True, {"n": len(action.get("token_ids", []))}


def ask(session, **req):
    return json.loads(handle(session, json.dumps({"lorasync_env": 1, **req})))


def test_session_answers_and_errors():
    s = Session(Flaky())
    assert ask(s, id=1, op="step", action={"text": "x"})["error"].startswith("step without an active episode")
    a = ask(s, id=2, op="reset", row={"index": 0}, seed=9)
    assert a == {"id": 2, "observation": {"messages": [{"role": "user", "content": "hello"}]},
                 "done": False, "info": {"seed": 9}}
    assert ask(s, id=3, op="step", action={"text": "raise"}) == {"id": 3, "error": "RuntimeError: env failed"}
    assert "error" in ask(s, id=4, op="step", action={"text": "x"})  # the failed episode is over
    assert "KeyError" in ask(s, id=5, op="reset", row={"boom": True}, seed=0)["error"]
    ask(s, id=6, op="reset", row={}, seed=0)
    assert "finite" in ask(s, id=7, op="step", action={"text": "nan"})["error"]
    ask(s, id=8, op="reset", row={}, seed=0)
    a = ask(s, id=9, op="step", action={"text": "ok", "token_ids": [1, 2]})
    assert a == {"id": 9, "observation": None, "reward": 2.0, "done": True, "info": {"n": 2}}
    assert "error" in ask(s, id=10, op="step", action={"text": "ok"})  # done: reset first
    assert json.loads(handle(s, b"not json"))["id"] is None
    assert "integer \"id\"" in ask(s, op="reset", row={}, seed=0)["error"]
    assert "supported: reset, step" in ask(s, id=11, op="nope")["error"]
    assert "supported: 1" in json.loads(handle(s, json.dumps({"lorasync_env": "1", "id": 12})))["error"]


STRAY = textwrap.dedent("""
    import os, sys
    from lorasync_env import Environment, main
    class Noisy(Environment):
        def __init__(self):
            print("constructing")
        def reset(self, row, seed):
            print("stray print in reset")
            os.write(1, b"raw write to fd 1\\n")
            sys.stdout.write("stdout.write\\n")
            return [{"role": "user", "content": "q\\u00e9\\n"}], {}
        def step(self, action):
            print("stray print in step")
            if action["text"] == "crash":
                raise ValueError("bad")
            return None, 0.5, True, {}
    main(Noisy)
""")


def test_stray_output_and_exceptions_keep_the_stream_clean():
    w = Worker("-c", STRAY)
    for _ in range(2):
        a = w.reset(0)
        assert check_obs(a) == [{"role": "user", "content": "q\u00e9\n"}]
        assert "ValueError: bad" in w.step("crash")["error"]
        w.reset(1)
        a = w.step("fine")
        assert a["reward"] == 0.5 and a["done"] is True and a["observation"] is None
    check_protocol_errors(w)
    w.p.stdin.close()
    assert w.p.stdout.read() == b""  # nothing but answers ever reached stdout
    assert w.p.wait(timeout=30) == 0
    err = w.stderr()
    assert "stray print in reset" in err and "raw write to fd 1" in err and "constructing" in err
    w.p.stdout.close()


# --- reasoning-gym -----------------------------------------------------------------------------

def test_reasoning_gym_matches_the_library_scorer():
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    tasks = ["chain_sum", "basic_arithmetic"]
    ref = reasoning_gym.create_dataset("composite", size=50, seed=1,
                                       datasets=[DatasetSpec(t, 1.0, {}) for t in tasks])
    w = Worker("-m", "lorasync_env.reasoning_gym_env", "--task", tasks[0], "--task", tasks[1],
               "--size", "50", "--seed", "1", "--max-turns", "2")
    check_protocol_errors(w)
    seen = set()
    for index in (0, 1, 2, 3, 53):
        entry = ref[index % 50]
        seen.add(entry["metadata"]["source_dataset"])
        msgs = check_obs(w.reset(index, seed=index))
        assert msgs[-1] == {"role": "user", "content": entry["question"]}
        assert msgs[0]["role"] == "system" and "<answer>" in msgs[0]["content"]
        # right answer at once
        a = w.step(f"Thinking... <answer>{entry['answer']}</answer>")
        assert a["done"] is True and a["observation"] is None
        assert a["reward"] == ref.score_answer(entry["answer"], entry) == 1.0
        # wrong, then wrong again: the retry message, then the library's score of the 2nd attempt
        w.reset(index)
        wrong = str(int(float(entry["answer"])) + 7)
        a = w.step(f"<answer>{wrong}</answer>")
        assert a["done"] is False and a["reward"] == 0.0
        assert check_obs(a) == [{"role": "user", "content": "That is not correct, try again."}]
        partial = entry["answer"] + "0"
        a = w.step(f"<answer>{partial}</answer>")
        assert a["done"] is True and a["reward"] == ref.score_answer(partial, entry) < 1.0
        # wrong, then right: reward 1 on the second attempt
        w.reset(index)
        assert w.step("no tags at all")["reward"] == 0.0
        a = w.step(f"<answer>{entry['answer']}</answer>")
        assert a["done"] and a["reward"] == 1.0 and a["info"]["attempt"] == 2
    assert seen == set(tasks)  # a mix
    assert w.close() == 0


# --- verifiers ---------------------------------------------------------------------------------

def test_verifiers_tool_env_matches_its_rubric():
    import verifiers as vf
    from verifiers.legacy.types import AssistantMessage

    rubric = vf.MathRubric()

    def rubric_reward(text, answer):
        comp = [AssistantMessage(content=text)]
        return asyncio.run(rubric.correct_answer(parser=rubric.parser, completion=comp, answer=answer))

    finals = []
    w = Worker("-m", "lorasync_env.verifiers_env", "--size", "20", "--seed", "3", "--max-turns", "3")
    check_protocol_errors(w)
    for index, right in ((4, True), (5, False), (4, True)):
        msgs = check_obs(w.reset(index))
        assert [m["role"] for m in msgs] == ["system", "user"] and "<tool_call>" in msgs[0]["content"]
        a, b, op, c = re.fullmatch(r"What is (\d+) \* (\d+) ([+-]) (\d+)\?", msgs[1]["content"]).groups()
        answer = int(a) * int(b) + (int(c) if op == "+" else -int(c))
        call = {"name": "calculate", "arguments": {"expression": f"{a} * {b} {op} {c}"}}
        r = w.step(f"Let me compute.\n<tool_call>{json.dumps(call)}</tool_call>")
        assert r["done"] is False and r["reward"] == 0.0
        assert check_obs(r) == [{"role": "tool", "content": str(answer)}]
        final = f"The answer is \\boxed{{{answer if right else answer + 1}}}."
        r = w.step(final)
        assert r["done"] is True and r["observation"] is None
        assert r["info"]["stop_condition"] == "no_tools_called"
        assert r["reward"] == (1.0 if right else 0.0)
        finals.append((final, str(answer), r["reward"]))
    # max_turns: three tool calls end the episode (verifiers' max_turns_reached), unanswered -> 0
    w.reset(0)
    bad = '<tool_call>{"name": "calculate", "arguments": {"expression": "1 +"}}</tool_call>'
    r = w.step(bad)
    assert r["observation"]["messages"][0]["content"].startswith("error:")
    w.step(bad)
    r = w.step(bad)
    assert r["done"] is True and r["reward"] == 0.0 and r["info"]["stop_condition"] == "max_turns_reached"
    # a reset in the middle of an episode abandons it
    w.reset(1)
    w.step(bad)
    w.reset(2)
    assert w.step("\\boxed{0}")["done"] is True
    assert w.close() == 0
    # The rubric's own verdicts, after the worker is gone: MathRubric forks a process pool, and a
    # fork while the worker runs would inherit our end of its stdin pipe (no EOF for the worker).
    for final, answer, reward in finals:
        assert rubric_reward(final, answer) == reward


# --- the example and the C++ tests' worker ----------------------------------------------------

def test_guess_number_example():
    w = Worker(str(ROOT / "examples/envs/guess_number.py"), "--low", "1", "--high", "100", "--max-turns", "7")
    for seed in (0, 1, 12345):
        w.reset(0, seed=seed)
        lo, hi, total = 1, 100, 0.0
        for _ in range(7):
            g = (lo + hi) // 2
            a = w.step(f"My guess is {g}")
            total += a["reward"]
            if a["done"]:
                break
            hint = check_obs(a)[0]["content"]
            lo, hi = (g + 1, hi) if hint == "higher" else (lo, g - 1)
        assert a["done"] and total == 1.0  # binary search finds 1..100 in 7 guesses
    w.reset(0, seed=1)
    outs = [w.step("50") for _ in range(7)]
    assert outs[-1]["done"] and sum(o["reward"] for o in outs) in (0.0, 1.0)
    assert w.close() == 0


# --- training through a real replica ------------------------------------------------------------

def test_training_on_reasoning_gym_records_the_library_rewards(tmp):
    """`lorasync train` with the reasoning-gym adapter as its environment (a mix of two tasks,
    up to 2 attempts, rows from env.rows) against a real `lorasync serve` replica and a tiny random
    model: a few steps run, and every trained episode's reward in episodes.jsonl equals
    reasoning-gym's own score of that episode's final attempt (its recorded text). The random
    model writes no <answer> tags, so these rewards are 0; the non-zero path is checked against the
    library above (test_reasoning_gym_matches_the_library_scorer)."""
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.utils import extract_answer

    from conftest import SHARED, lorasync, serve

    model = tmp / "tiny"
    lorasync("init-model", "--preset", "tiny", "--seed", 5, "--init-std", 0.1, "--tokenizer",
             SHARED / "data/qwen2-tokenizer", "--output", model)
    srv = serve(model, "--served-model-name", "tiny", "--max-loras", 4, "--max-lora-rank", 8,
                "--allowed-adapter-root", tmp, "--threads", 1)
    try:
        tasks = ["chain_sum", "basic_arithmetic"]
        run = tmp / "run"
        cfg = tmp / "train.toml"
        cfg.write_text(textwrap.dedent(f"""\
            run_name = "env"
            output_dir = "{run}"
            max_steps = 3
            seed = 3
            [model]
            path = "{model}"
            served_name = "tiny"
            device = "cpu"
            dtype = "fp32"
            threads = 1
            [lora]
            rank = 4
            alpha = 8.0
            [generation]
            server_url = "{srv.url}"
            max_new_tokens = 16
            context_len = 512
            server_wait_s = 20
            [data]
            max_prompt_tokens = 256
            [grpo]
            num_generations = 4
            [async]
            max_inflight = 16
            max_staleness = 1
            [batching]
            samples_per_step = 8
            row_tokens = 2048
            logits_chunk = 512
            [sync]
            weight_sync_steps = 2
            [logging]
            metrics_port = -1
            [env]
            command = [{json.dumps(PY)}, "-m", "lorasync_env.reasoning_gym_env", "--task", "{tasks[0]}", "--task", "{tasks[1]}", "--size", "50", "--seed", "1", "--max-turns", "2"]
            environment = ["PYTHONPATH={ROOT / 'python'}"]
            rows = 50
            workers = 4
            timeout_s = 120
            startup_s = 120
            max_turns = 2
            memory_mb = 8192
            """))
        p = lorasync("train", "--config", cfg, timeout=600)
        metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 3
        for m in metrics:
            assert m["rollout/env_crashed_total"] == 0 and m["rollout/env_invalid_total"] == 0, m
            assert m["rollout/env_timeout_total"] == 0 and m["rollout/env_error_total"] == 0, m
            assert 1.0 <= m["episode/turns_mean"] <= 2.0
        ref = reasoning_gym.create_dataset("composite", size=50, seed=1,
                                           datasets=[DatasetSpec(t, 1.0, {}) for t in tasks])
        episodes = [json.loads(l) for l in (run / "episodes.jsonl").read_text().splitlines()]
        assert len(episodes) == 3 * 8
        for e in episodes:
            entry = ref[e["prompt"] % 50]
            assert 1 <= e["turns"] <= 2 and len(e["text"]) == e["turns"]
            expected = float(ref.score_answer(extract_answer(e["text"][-1]), entry))
            assert e["reward"] == expected, e
        print(f"reasoning-gym training: {len(episodes)} episodes, "
              f"{sum(e['turns'] for e in episodes)} turns, rewards {sorted({e['reward'] for e in episodes})}")
        del p
    finally:
        srv.stop()
