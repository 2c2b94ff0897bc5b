"""A `verifiers` tool environment (verifiers' classic stack: `ToolEnv` + `MathRubric`) as a
lorasync environment.

    python -m lorasync_env.verifiers_env --size 200 --seed 1 --max-turns 4

verifiers runs its own rollout loop and asks a `Client` for each model turn. This adapter does not
re-implement that loop: it runs verifiers' unchanged `ToolEnv.rollout()` (and then the env's own
rubric, `rubric.score_rollout`) on a background event loop with a bridge `Client` whose
`get_response` hands the conversation to the trainer (the observation) and waits for the next
`step` request (the model's turn). So turns, tool execution, stop conditions and the reward are
all verifiers' own:

- dataset (built in code, nothing downloaded): `--size` arithmetic problems from `--seed`, e.g.
  "What is 4817 * 93 - 2210?", answer the exact integer;
- tool: `calculate(expression)` (our safe arithmetic evaluator, exposed through `ToolEnv`);
- the model calls it by writing `<tool_call>{"name": "calculate", "arguments": {...}}</tool_call>`
  (the Hermes/Qwen convention, described in the system prompt); the bridge turns those blocks
  into verifiers tool calls, as an OpenAI server's tool parser would, and ToolEnv answers each
  with a "tool" message (the next observation);
- the episode ends when verifiers says so: a turn without a tool call (`no_tools_called`) or
  `--max-turns` model turns (`max_turns_reached`);
- reward: the env's rubric, `MathRubric` (the last \\boxed{} of the final turn checked with
  math-verify) plus ToolEnv's monitor metrics (weight 0); given on the final step, 0 before.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import queue
import random
import re
import sys
import threading
import time
import uuid

from .protocol import Environment, main

SYSTEM_PROMPT = """You are solving an arithmetic problem. You have one tool:

calculate(expression: str) -> str: evaluates an arithmetic expression with + - * / // % ** and
parentheses, e.g. "(12 + 5) * 3".

To call it, write exactly one line per call:
<tool_call>{"name": "calculate", "arguments": {"expression": "..."}}</tool_call>
and stop; the result comes back in a tool message. When you know the answer, reply without a tool
call and put the final answer in \\boxed{}."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. "(12 + 5) * 3"
    """
    if len(expression) > 200:
        return "error: expression too long"
    try:
        return str(_eval(ast.parse(expression, mode="eval")))
    except Exception as e:  # the model sees the error, as ToolEnv does
        return f"error: {e}"


def make_rows(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b, c = rng.randint(100, 9999), rng.randint(11, 999), rng.randint(1, 9999)
        op = rng.choice(["+", "-"])
        rows.append({"question": f"What is {a} * {b} {op} {c}?",
                     "answer": str(a * b + c if op == "+" else a * b - c)})
    return rows


def build_env(size: int = 1000, seed: int = 0, max_turns: int = 4):
    """The verifiers environment this adapter runs (also used by the conformance test)."""
    from datasets import Dataset
    import verifiers as vf

    rubric = vf.MathRubric()
    return vf.ToolEnv(dataset=Dataset.from_list(make_rows(size, seed)), tools=[calculate],
                      max_turns=max_turns, system_prompt=SYSTEM_PROMPT, parser=rubric.parser,
                      rubric=rubric)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content before the first call, [(name, arguments JSON)]) from Hermes-style blocks.
    A block that is not a JSON object with a "name" stays plain text."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append((obj["name"], json.dumps(obj.get("arguments", {}))))
    if not calls:
        return text, []
    return text[:text.find("<tool_call>")].rstrip(), calls


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(getattr(p, "text", None) or (p.get("text", "") if isinstance(p, dict) else "")
                       for p in content)
    return "" if content is None else str(content)


class _Bridge:
    """The verifiers Client whose model is the trainer: each get_response publishes the prompt
    and awaits the action that the next `step` brings."""

    def __init__(self, loop, events: queue.Queue):
        from verifiers.legacy.clients.client import Client
        from verifiers.legacy.types import Response, ResponseMessage, ToolCall, Usage

        bridge = self

        class BridgeClient(Client):
            def setup_client(self, config):
                raise NotImplementedError
            async def to_native_tool(self, tool):
                return tool
            async def to_native_prompt(self, messages):
                return messages, {}
            async def get_native_response(self, prompt, model, sampling_args, tools=None, **kw):
                raise NotImplementedError
            async def raise_from_native_response(self, response):
                return None
            async def from_native_response(self, response):
                return response
            async def close(self):
                return None

            async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
                action = await bridge.model_turn(prompt)
                text = action.get("text", "")
                content, calls = parse_tool_calls(text)
                n = len(action.get("token_ids") or [])
                finish = action.get("finish_reason", "stop")
                return Response(
                    id=uuid.uuid4().hex, created=int(time.time()), model=model,
                    usage=Usage(prompt_tokens=0, reasoning_tokens=0, completion_tokens=n, total_tokens=n),
                    message=ResponseMessage(
                        content=content,
                        tool_calls=[ToolCall(id=f"call_{i}", name=name, arguments=args)
                                    for i, (name, args) in enumerate(calls)] or None,
                        finish_reason="tool_calls" if calls else ("length" if finish == "length" else "stop"),
                        is_truncated=finish == "length"))

        self.client = BridgeClient(None)
        self.loop = loop
        self.events = events
        self.pending = None  # the future the current model turn waits on

    async def model_turn(self, prompt):
        self.pending = self.loop.create_future()
        self.events.put(("turn", list(prompt)))
        return await self.pending


class VerifiersEnv(Environment):
    def __init__(self, size: int = 1000, seed: int = 0, max_turns: int = 4):
        self.env = build_env(size, seed, max_turns)
        self.dataset = self.env.get_dataset()
        self.size = len(self.dataset)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="verifiers").start()
        self.events: queue.Queue = queue.Queue()
        self.bridge = _Bridge(self.loop, self.events)
        self.task = None
        self.seen = 0

    async def _episode(self, row):
        state = None
        try:
            state = await self.env.rollout(dict(row), self.bridge.client, "lorasync", {})
            await self.env.rubric.score_rollout(state)
            await self.env.rubric.cleanup(state)
            self.events.put(("done", state))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.events.put(("error", e))

    def _next_event(self):
        kind, payload = self.events.get()
        if kind == "error":
            raise payload
        return kind, payload

    def _observation(self, prompt):
        new = prompt[self.seen:]
        self.seen = len(prompt) + 1  # plus the model's own turn
        out = []
        for m in new:
            role = getattr(m, "role", None) or m.get("role")
            if role not in ("system", "user", "tool"):
                raise ValueError(f"verifiers produced a {role!r} message the trainer cannot send")
            out.append({"role": role, "content": _content_text(getattr(m, "content", None)
                                                                if not isinstance(m, dict) else m.get("content"))})
        return out

    def _abandon(self):
        if self.task is not None and not self.task.done():
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.task = None
        self.events = queue.Queue()
        self.bridge.events = self.events

    def reset(self, row, seed):
        self._abandon()
        index = row.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError('row "index" must be an integer')
        item = self.dataset[index % self.size]
        self.seen = 0
        self.task = asyncio.run_coroutine_threadsafe(self._episode(item), self.loop)
        kind, payload = self._next_event()
        if kind != "turn":
            raise RuntimeError("verifiers ended the rollout before the first model turn")
        return self._observation(payload), {"item": index % self.size}

    def step(self, action):
        fut = self.bridge.pending
        if fut is None or fut.done():
            raise RuntimeError("no model turn is pending")
        self.loop.call_soon_threadsafe(fut.set_result, action)
        kind, payload = self._next_event()
        if kind == "turn":
            return self._observation(payload), 0.0, False, {}
        state = payload
        info = {"stop_condition": state.get("stop_condition"), "metrics": state.get("metrics") or {},
                "turns": len(state.get("trajectory") or [])}
        if state.get("error") is not None:
            raise RuntimeError(f"verifiers rollout failed: {state['error']!r}")
        return None, float(state.get("reward") or 0.0), True, info

    def close(self):
        self._abandon()
        try:  # the rubric's math-verify process pool; a live pool would keep the worker from exiting
            asyncio.run_coroutine_threadsafe(self.env._teardown(), self.loop).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m lorasync_env.verifiers_env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-turns", type=int, default=4, help="model turns per episode (ToolEnv max_turns)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    main(lambda: VerifiersEnv(args.size, args.seed, args.max_turns))
