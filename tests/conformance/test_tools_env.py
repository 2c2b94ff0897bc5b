"""lorasync_env.tools_env (docs/environments.md, "Tools") driven as a worker subprocess over
protocol v1: rewards against math-verify's own parse()/verify() on the same strings, the
calculator and python tools, a runaway snippet killed at its timeout, every malformed tool call
answered by a tool error while the episode goes on, and the --max-turns limit."""

import json
import time

import pytest
from math_verify import parse, verify

from test_environments import Worker, check_obs, check_protocol_errors

PROBLEM = "What is $\\frac{3}{6}$ in lowest terms?"
ANSWERS = ["\\frac{1}{2}"]
MAX_TURNS = 3
TIMEOUT_S = 1


@pytest.fixture(scope="module")
def worker():
    w = Worker("-m", "lorasync_env.tools_env", "--max-turns", str(MAX_TURNS),
               "--python-timeout-s", str(TIMEOUT_S), "--tools", "calculator,python", timeout=30)
    yield w
    assert w.close() == 0, w.stderr()


def reset(w, problem=PROBLEM, answers=ANSWERS, index=0):
    ans = w.request(op="reset", row={"index": index, "problem": problem, "answers": answers}, seed=7)
    assert ans["done"] is False and "error" not in ans, ans
    return check_obs(ans)


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def tool_turn(w, text):
    """A non-final turn: the tool messages' contents and the info."""
    ans = w.step(text)
    assert "error" not in ans and ans["done"] is False and ans["reward"] == 0.0, ans
    msgs = check_obs(ans)
    assert all(m["role"] == "tool" for m in msgs), msgs
    assert ans["info"]["final"] is False
    return [m["content"] for m in msgs], ans["info"]


def mv_reward(boxed, answers):
    gold = [parse(f"${a}$") for a in answers]
    pred = parse(f"\\boxed{{{boxed}}}")
    return 1.0 if pred and any(g and verify(g, pred) for g in gold) else 0.0


def test_first_observation_describes_the_tools(worker):
    msgs = reset(worker)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[1]["content"] == PROBLEM
    sys_prompt = msgs[0]["content"]
    # Qwen2.5's chat template's own tool section, with both signatures
    assert "# Tools\n\nYou may call one or more functions to assist with the user query." in sys_prompt
    assert ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
            in sys_prompt)
    tools = sys_prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    names = [json.loads(t)["function"]["name"] for t in tools]
    assert names == ["calculator", "python"]
    assert "\\boxed{}" in sys_prompt


# (final turn, its last boxed content, answers): the reward must be math-verify's verdict
FINALS = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", ANSWERS, 1.0),
    ("So \\boxed{0.5}", "0.5", ANSWERS, 1.0),
    ("First \\boxed{2}, no wait: \\boxed{1/2}", "1/2", ANSWERS, 1.0),
    ("It is \\boxed{\\frac{1}{3}}.", "\\frac{1}{3}", ANSWERS, 0.0),
    ("It is \\boxed{1/2}, then \\boxed{3}", "3", ANSWERS, 0.0),
    ("No box: the answer is 1/2.", None, ANSWERS, 0.0),
    ("\\boxed{x^{2}+1}", "x^{2}+1", ["x^2 + 1"], 1.0),
    ("\\boxed{(1, 2)}", "(1, 2)", ["(2, 1)", "(1,2)"], 1.0),
    ("\\boxed{7}", "7", ["8", "9"], 0.0),
]


@pytest.mark.parametrize("text,boxed,answers,expected", FINALS)
def test_final_answer_reward_is_math_verifys(worker, text, boxed, answers, expected):
    reset(worker, answers=answers)
    ans = worker.step(text)
    assert ans["done"] is True and ans["observation"] is None, ans
    assert ans["info"] == {"tool_calls": 0, "tool_errors": 0, "final": True}
    want = 0.0 if boxed is None else mv_reward(boxed, answers)
    assert want == expected  # the cases mean what they say
    assert ans["reward"] == want


def test_calculator_and_python_calls_then_a_final_answer(worker):
    reset(worker)
    out, info = tool_turn(worker, "Let me compute.\n" + call("calculator", expression="3 * (4 + 5) - 2**10")
                          + "\n" + call("calculator", expression="sqrt(16) + factorial(5) + comb(10, 3)")
                          + "\n" + call("calculator", expression="gcd(12, 18) / 4 + 7 // 2 + 7 % 3"))
    assert out == [str(3 * (4 + 5) - 2 ** 10), "244.0", "5.5"]
    assert info == {"tool_calls": 3, "tool_errors": 0, "final": False}
    out, info = tool_turn(worker, call("python", code="from fractions import Fraction\n"
                                                      "print(Fraction(3, 6))\nprint(sum(range(101)))"))
    assert out == ["1/2\n5050\n"] and info["tool_errors"] == 0
    ans = worker.step("Hence \\boxed{\\frac{1}{2}}")
    assert ans["done"] is True and ans["reward"] == 1.0 and ans["info"]["final"] is True


def test_tool_errors_are_reported(worker):
    reset(worker)
    out, info = tool_turn(worker, call("calculator", expression="1/0") + call("calculator", expression="__import__('os')")
                          + call("python", code="import sys; print('partial'); sys.exit(3)"))
    assert out[0] == "error: division by zero"
    assert out[1].startswith("error: unknown function")
    assert out[2].startswith("partial\n") and out[2].endswith("[exit status 3]")
    assert info == {"tool_calls": 3, "tool_errors": 3, "final": False}
    out, _ = tool_turn(worker, call("calculator", expression="9**9**9") + call("python", code="print('x' * 5000)"))
    assert out[0].startswith("error: result too large")
    assert out[1].startswith("x" * 2048 + "\n[output truncated") and len(out[1]) < 2200


def test_a_runaway_snippet_is_killed_and_the_worker_goes_on(worker):
    reset(worker)
    t0 = time.monotonic()
    out, info = tool_turn(worker, call("python", code="print('started', flush=True)\nwhile True:\n    pass"))
    spent = time.monotonic() - t0
    assert TIMEOUT_S <= spent < TIMEOUT_S + 3, spent
    assert out[0].startswith("started\n") and f"ran longer than the {TIMEOUT_S} s time limit" in out[0]
    assert info["tool_errors"] == 1
    out, info = tool_turn(worker, call("python", code="print(6 * 7)"))  # same episode, same worker
    assert out == ["42\n"] and info["tool_errors"] == 0
    ans = worker.step("\\boxed{1/2}")
    assert ans["done"] is True and ans["reward"] == 1.0


HUGE = call("python", code="x = 1\n" * 2000)  # > 8 KB
MALFORMED = [
    ("<tool_call>\n{'name': 'calculator', 'arguments': {'expression': '1+1'}}\n</tool_call>",
     ["not valid JSON", "double quotes"]),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1",},}\n</tool_call>',
     ["not valid JSON", "trailing commas"]),
    ('<tool_call>\n{"arguments": {"expression": "1+1"}}\n</tool_call>', ['no "name"']),
    ('<tool_call>\n{"name": "calculator"}\n</tool_call>', ['no "arguments"']),
    (call("wolfram", query="1+1"), ['unknown tool "wolfram"', "calculator, python"]),
    ('<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>',
     ['"arguments" must be a JSON object, not a string']),
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}', ["unterminated"]),
    (HUGE, ["larger than 8 KB"]),
    ('<tool_call>\n["calculator", {"expression": "1+1"}]\n</tool_call>', ["must be a JSON object"]),
    ("<tool_call>\n</tool_call>", ["empty"]),
    ('{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>', ["without a matching"]),
    (call("calculator", expr="1+1"), ['takes one argument, "expression"']),
    (call("python", code=["print(1)"]), ['needs "code" (a string)']),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": NaN}}</tool_call>', ["not valid JSON"]),
]


@pytest.mark.parametrize("text,needles", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_call_is_a_tool_error_and_the_episode_goes_on(worker, text, needles):
    reset(worker)
    assert len(HUGE.encode()) > 8192
    out, info = tool_turn(worker, "I will call a tool.\n" + text)
    assert len(out) == 1 and out[0].startswith("error: "), out
    for n in needles:
        assert n in out[0], (n, out[0])
    assert info == {"tool_calls": 1, "tool_errors": 1, "final": False}
    ans = worker.step("\\boxed{\\frac{1}{2}}")
    assert ans["done"] is True and ans["reward"] == 1.0


def test_valid_and_malformed_calls_in_one_turn(worker):
    reset(worker)
    out, info = tool_turn(worker, call("calculator", expression="2+3")
                          + "<tool_call>{'name': 'x'}</tool_call>"
                          + call("calculator", expression="10*10")
                          + '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}')
    assert out[0] == "5" and out[1].startswith("error: the tool call is not valid JSON")
    assert out[2] == "100" and out[3].startswith("error: unterminated")
    assert info == {"tool_calls": 4, "tool_errors": 2, "final": False}
    out, info = tool_turn(worker, "".join(call("calculator", expression=str(i)) for i in range(6)))
    assert out[:4] == ["0", "1", "2", "3"] and out[4] == "error: 2 more tool call(s) not run: at most 4 per turn"
    assert info == {"tool_calls": 6, "tool_errors": 2, "final": False}


def test_max_turns_ends_the_episode(worker):
    reset(worker)
    for _ in range(MAX_TURNS - 1):
        tool_turn(worker, call("calculator", expression="1+1"))
    ans = worker.step(call("calculator", expression="1+1") + " \\boxed{\\frac{1}{2}}")
    assert ans["done"] is True and ans["observation"] is None and ans["reward"] == 0.0, ans
    assert ans["info"] == {"tool_calls": 1, "tool_errors": 0, "final": False}
    assert "error" in worker.step("\\boxed{1/2}")  # the episode is over: reset first
    reset(worker)  # and the next one starts afresh
    for _ in range(MAX_TURNS - 1):
        tool_turn(worker, call("calculator", expression="1+1"))
    ans = worker.step("\\boxed{1/2}")  # a final answer on the last turn is graded
    assert ans["done"] is True and ans["reward"] == 1.0


def test_bad_rows_and_protocol_errors(worker):
    assert "problem" in worker.request(op="reset", row={"index": 1, "answers": ["1"]}, seed=0)["error"]
    assert "answers" in worker.request(op="reset", row={"index": 1, "problem": "p", "answers": []}, seed=0)["error"]
    check_protocol_errors(worker)
    reset(worker)  # still serving


def test_bad_arguments_exit_2():
    w = Worker("-m", "lorasync_env.tools_env", "--tools", "calculator,shell")
    assert w.p.wait(timeout=30) == 2
    assert "unknown ['shell']" in w.stderr()
    assert w.close() == 2
