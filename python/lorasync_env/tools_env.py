"""A tool-using maths environment: MATH problems, a calculator and a Python sandbox.

    python -m lorasync_env.tools_env [--max-turns 4] [--tools calculator,python] \
        [--python-timeout-s 5] [--max-calls 4]

Rows are the trainer's own: {"index", "problem", "answers"} (a MATH problem and its reference
answers). The first observation is a system message that describes the tools exactly as the
Qwen2.5 chat template does when it is given tools (a "# Tools" section with the JSON signatures
inside <tools></tools>), and the problem as the user message.

The model calls a tool by writing, one block per call (several blocks per turn allowed):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}
    </tool_call>

Each block gets one "tool" message (the trainer renders it as Qwen's <tool_response> user turn)
with the tool's result, or a message starting "error:" for a block that cannot be run: not strict
JSON (single quotes, trailing commas, NaN ... are refused, with a hint), not an object, no "name",
an unknown tool, "arguments" missing or not an object, wrong argument names or types, an
unterminated block, a block over 8 KB, a stray </tool_call>, or more than --max-calls blocks in a
turn. Such a turn is not final: the episode goes on.

A turn without any <tool_call> or </tool_call> tag is the final answer: reward 1.0 when its last
\\boxed{...} equals one of the row's answers under math-verify (`verify(parse("$answer$"),
parse("\\boxed{...}"))`), else 0.0, and the episode is done. A turn with tool calls on the
--max-turns-th turn ends the episode with reward 0 (no final answer was given).

Tools:
- calculator(expression): our own ast-based evaluator: numbers, + - * / // % **, parentheses,
  unary minus/plus, the functions sqrt sin cos tan log exp factorial gcd comb and the constants
  pi e; exponents, factorial and comb arguments and results are bounded. Nothing is eval()'d.
- python(code): the snippet runs in a separate `python3 -I -S` process (this interpreter, isolated
  mode, no site-packages: the standard library only), in an empty temporary directory, in its own
  process group, with RLIMIT_AS 512 MiB, RLIMIT_CPU of the timeout, no core files, 16 MiB files,
  stdin empty; it is killed (the whole group) after --python-timeout-s seconds of wall time.
  stdout and stderr are captured together and truncated to 2 KB; the result is that output, plus
  "[exit status N]" / "[killed ...]" when it did not exit cleanly. No network isolation of its
  own: the trainer's sandbox isolates the worker (env.network = false).

Info per step: {"tool_calls": blocks in the turn, "tool_errors": those that failed (malformed or
the tool reported an error: calculator error, python non-zero exit or kill), "final": the turn
was graded}.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time

from .protocol import Environment, main, system, tool, user

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_BLOCK_BYTES = 8 * 1024
MAX_OUTPUT_BYTES = 2 * 1024
MAX_EXPRESSION_CHARS = 1000
PYTHON_MEMORY_BYTES = 512 * 1024 * 1024
TOOL_NAMES = ("calculator", "python")

TOOL_SCHEMAS = {
    "calculator": {"type": "function", "function": {
        "name": "calculator",
        "description": ("Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses, "
                        "the functions sqrt, sin, cos, tan, log, exp, factorial, gcd, comb and the "
                        "constants pi and e. Returns the value."),
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "e.g. \"sqrt(2) * (3 + 4)**2\""}},
            "required": ["expression"]}}},
    "python": {"type": "function", "function": {
        "name": "python",
        "description": ("Run a Python 3 program (standard library only) and return what it prints "
                        "(stdout and stderr, at most 2 KB). Each call is a fresh process with a "
                        "time limit; use print() to see results."),
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "the program"}},
            "required": ["code"]}}},
}

INSTRUCTIONS = ("Solve the math problem. You may use the tools to compute. When you are done, reply "
                "without a tool call and put the final answer in \\boxed{}.")


def system_prompt(tools: list[str]) -> str:
    """The instructions plus the tools section as Qwen2.5's chat template writes it."""
    sigs = "\n".join(json.dumps(TOOL_SCHEMAS[t], ensure_ascii=False) for t in tools)
    return (f"{INSTRUCTIONS}\n\n# Tools\n\nYou may call one or more functions to assist with the user "
            f"query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\nFor each function call, return a json object with function "
            f"name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            f'{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


# --- tool-call parsing ---------------------------------------------------------------------------

class CallError(Exception):
    """A tool-call block that cannot be run; the message is what the model sees."""


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _json_hint(body: str) -> str:
    hints = []
    if re.search(r"(^|[{\[,:]\s*)'", body):
        hints.append("strings and keys need double quotes, not single quotes")
    if re.search(r",\s*[}\]]", body):
        hints.append("no trailing commas")
    return "; ".join(hints) or 'write {"name": "...", "arguments": {...}} as strict JSON'


def parse_call(body: str, tools: dict) -> tuple[str, dict]:
    """(name, arguments) of one block's text; raises CallError."""
    if len(body.encode("utf-8", "surrogatepass")) > MAX_BLOCK_BYTES:
        raise CallError(f"the tool call is larger than {MAX_BLOCK_BYTES // 1024} KB")
    body = body.strip()
    if not body:
        raise CallError("the tool call is empty")
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise CallError(f"the tool call is not valid JSON ({e}); {_json_hint(body)}") from None
    if not isinstance(obj, dict):
        raise CallError(f"the tool call must be a JSON object, not {type(obj).__name__}")
    if "name" not in obj:
        raise CallError('the tool call has no "name"')
    name = obj["name"]
    if not isinstance(name, str):
        raise CallError('"name" must be a string')
    if name not in tools:
        raise CallError(f"unknown tool {json.dumps(name)[:100]}; available: {', '.join(tools)}")
    if "arguments" not in obj:
        raise CallError(f'the call to {name} has no "arguments"')
    args = obj["arguments"]
    if not isinstance(args, dict):
        raise CallError(f'"arguments" must be a JSON object, not {_json_type(args)}')
    return name, args


def _json_type(v) -> str:
    return {str: "a string", list: "an array", int: "a number", float: "a number", bool: "a boolean",
            type(None): "null"}.get(type(v), type(v).__name__)


def find_calls(text: str) -> tuple[list[tuple[str, str | None]], list[str]]:
    """Splits a turn into tool-call blocks: ([(body, None) or (None, error)], stray-tag errors).
    A block runs from <tool_call> to the next </tool_call>; a <tool_call> followed by another
    <tool_call> (or by nothing) before its closing tag is unterminated."""
    blocks: list[tuple[str | None, str | None]] = []
    errors: list[str] = []
    pos, end = 0, -1
    while True:
        start = text.find(OPEN, pos)
        stray = text.count(CLOSE, pos, len(text) if start < 0 else start)
        if stray:
            errors.append(f"{CLOSE} without a matching {OPEN}" + (f" ({stray} times)" if stray > 1 else ""))
        if start < 0:
            break
        begin = start + len(OPEN)
        if end != len(text) and end < begin:  # the next closing tag (searched once per tag)
            end = text.find(CLOSE, begin)
            end = len(text) if end < 0 else end
        reopen = text.find(OPEN, begin)
        if end == len(text) or (0 <= reopen < end):
            blocks.append((None, f"unterminated tool call: {OPEN} without {CLOSE}"
                           + (" before the next <tool_call>" if 0 <= reopen else "")))
            if reopen < 0:
                break
            pos = reopen
            continue
        blocks.append((text[begin:end], None))
        pos = end + len(CLOSE)
    return blocks, errors


# --- calculator ----------------------------------------------------------------------------------

MAX_INT_BITS = 4096
MAX_FACTORIAL = 1000
MAX_COMB_N = 10000


def _check_int(v):
    if isinstance(v, int) and v.bit_length() > MAX_INT_BITS:
        raise ValueError(f"result too large (over {MAX_INT_BITS} bits)")
    return v


def _pow(a, b):
    if isinstance(b, int) and isinstance(a, int) and b > 0 and abs(a) > 1:
        if (a.bit_length() - 1) * b > MAX_INT_BITS:  # a lower bound of the result's size
            raise ValueError(f"result too large (over {MAX_INT_BITS} bits)")
    elif abs(b) > 100000:
        raise ValueError("exponent too large")
    r = a ** b
    if isinstance(r, complex):
        raise ValueError("the result is complex (negative number to a fractional power)")
    return r


def _int_arg(v, what):
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int):
        raise ValueError(f"{what} needs integers")
    return v


def _factorial(n):
    n = _int_arg(n, "factorial")
    if n < 0 or n > MAX_FACTORIAL:
        raise ValueError(f"factorial needs 0 <= n <= {MAX_FACTORIAL}")
    return math.factorial(n)


def _comb(n, k):
    n, k = _int_arg(n, "comb"), _int_arg(k, "comb")
    if n < 0 or k < 0 or n > MAX_COMB_N:
        raise ValueError(f"comb needs 0 <= k and 0 <= n <= {MAX_COMB_N}")
    return math.comb(n, k)


def _gcd(*xs):
    return math.gcd(*(_int_arg(x, "gcd") for x in xs))


def _log(x, base=None):
    return math.log(x) if base is None else math.log(x, base)


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b,
           ast.Mod: lambda a, b: a % b, ast.Pow: _pow}
_FUNCS = {"sqrt": (math.sqrt, 1, 1), "sin": (math.sin, 1, 1), "cos": (math.cos, 1, 1),
          "tan": (math.tan, 1, 1), "log": (_log, 1, 2), "exp": (math.exp, 1, 1),
          "factorial": (_factorial, 1, 1), "gcd": (_gcd, 1, 8), "comb": (_comb, 2, 2)}
_CONSTS = {"pi": math.pi, "e": math.e}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _check_int(node.value)
        raise ValueError(f"only numbers are allowed, not {node.value!r:.40}")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _check_int(_BINOPS[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Name):
        if node.id in _CONSTS:
            return _CONSTS[node.id]
        raise ValueError(f"unknown name {node.id!r:.40}; constants: pi, e")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS:
            raise ValueError(f"unknown function; allowed: {', '.join(_FUNCS)}")
        fn, lo, hi = _FUNCS[node.func.id]
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ValueError(f"{node.func.id}() takes positional arguments only")
        if not lo <= len(node.args) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise ValueError(f"{node.func.id}() takes {want} argument(s), got {len(node.args)}")
        return _check_int(fn(*(_eval(a) for a in node.args)))
    raise ValueError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % **, "
                     f"parentheses, {', '.join(_FUNCS)}, pi and e")


def calculate(expression: str) -> tuple[str, bool]:
    """(result text, ok) of an arithmetic expression; never raises."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters", False
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval"))
        if isinstance(value, float) and not math.isfinite(value):
            return "error: numerical result out of range", False
        return (repr(value) if isinstance(value, float) else str(value)), True
    except ZeroDivisionError:
        return "error: division by zero", False
    except SyntaxError as e:
        return f"error: not a valid expression ({e.msg})", False
    except OverflowError:
        return "error: numerical result out of range", False
    except RecursionError:
        return "error: expression nested too deeply", False
    except (ValueError, TypeError, ArithmeticError, MemoryError) as e:
        return f"error: {e}", False


# --- python --------------------------------------------------------------------------------------

def _limit(resource, which, value):
    soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value if hard == resource.RLIM_INFINITY else hard))


def _child_limits(cpu_s: int):
    import resource
    _limit(resource, resource.RLIMIT_AS, PYTHON_MEMORY_BYTES)
    _limit(resource, resource.RLIMIT_CPU, cpu_s)
    _limit(resource, resource.RLIMIT_CORE, 0)
    _limit(resource, resource.RLIMIT_FSIZE, 16 * 1024 * 1024)


def _signal_name(n: int) -> str:
    try:
        name = signal.Signals(n).name
    except ValueError:
        name = f"signal {n}"
    why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": "", "SIGSEGV": " (memory limit?)",
           "SIGXFSZ": " (file size limit)"}.get(name, "")
    return name + why


def run_python(code: str, timeout_s: float, interpreter: str = sys.executable) -> tuple[str, bool]:
    """(captured output and status, ok) of a snippet run in a limited `python3 -I -S`; never raises."""
    if "\0" in code:
        return "error: the code contains a NUL character", False
    with tempfile.TemporaryDirectory(prefix="lorasync-tool-") as cwd:
        try:
            p = subprocess.Popen([interpreter, "-I", "-S", "-c", code], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd,
                                 env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8",
                                      "HOME": cwd, "TMPDIR": cwd},
                                 start_new_session=True, close_fds=True,
                                 preexec_fn=lambda: _child_limits(max(1, math.ceil(timeout_s)) + 1))
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            return f"error: could not start python: {e}", False
        out, total, timed_out = bytearray(), 0, False
        fd = p.stdout.fileno()
        os.set_blocking(fd, False)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                ready, _, _ = select.select([fd], [], [], min(left, 0.1))
                eof = False
                while ready:
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    if not chunk:
                        eof = True
                        break
                    total += len(chunk)
                    if len(out) < MAX_OUTPUT_BYTES:
                        out += chunk[:MAX_OUTPUT_BYTES - len(out)]
                if eof or (not ready and p.poll() is not None):
                    break  # output ended, or the program exited (a background child may hold the pipe)
            if not timed_out and p.poll() is None:  # it closed its output but runs on
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the snippet and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            rc = p.wait()
            p.stdout.close()
    text = out.decode("utf-8", "replace")
    if total > len(out):
        text += f"\n[output truncated: {total} bytes in all, the first {MAX_OUTPUT_BYTES} shown]"
    if timed_out:
        text += f"\n[killed: the program ran longer than the {timeout_s:g} s time limit]"
        return text.lstrip("\n"), False
    if rc < 0:
        text += f"\n[killed by {_signal_name(-rc)}]"
        return text.lstrip("\n"), False
    if rc != 0:
        text += f"\n[exit status {rc}]"
        return text.lstrip("\n"), False
    return text if text.strip() else "(no output: use print() to see results)", True


# --- grading -------------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} whose braces balance, None without one (one pass)."""
    match, stack = {}, []
    for k, ch in enumerate(text):
        if ch == "{":
            stack.append(k)
        elif ch == "}" and stack:
            match[stack.pop()] = k
    start = text.rfind("\\boxed{")
    while start >= 0:
        brace = start + len("\\boxed")
        if brace in match:
            return text[brace + 1:match[brace]]
        start = text.rfind("\\boxed{", 0, start)
    return None


class Grader:
    """math-verify (the pinned math-verify package): gold parsed as `$answer$`, the prediction as
    `\\boxed{content}`; correct when verify() holds for any gold."""

    def __init__(self):
        from math_verify import parse, verify
        self.parse, self.verify = parse, verify

    def gold(self, answer: str):
        return self.parse(f"${answer}$")

    def __call__(self, boxed: str | None, golds: list) -> float:
        if boxed is None or not boxed.strip():
            return 0.0
        try:
            pred = self.parse(f"\\boxed{{{boxed}}}")
            return 1.0 if pred and any(g and self.verify(g, pred) for g in golds) else 0.0
        except Exception:  # math-verify catches its own errors; a wrong answer, whatever else
            return 0.0


# --- the environment -----------------------------------------------------------------------------

class ToolsEnv(Environment):
    def __init__(self, max_turns: int = 4, tools: list[str] | tuple[str, ...] = TOOL_NAMES,
                 python_timeout_s: float = 5.0, max_calls: int = 4):
        if max_turns < 1:
            raise ValueError("--max-turns must be at least 1")
        if max_calls < 1:
            raise ValueError("--max-calls must be at least 1")
        if not python_timeout_s > 0:
            raise ValueError("--python-timeout-s must be positive")
        tools = list(dict.fromkeys(tools))
        unknown = [t for t in tools if t not in TOOL_NAMES]
        if unknown or not tools:
            raise ValueError(f"--tools: unknown {unknown}; choose from {', '.join(TOOL_NAMES)}")
        self.max_turns, self.max_calls, self.python_timeout_s = max_turns, max_calls, python_timeout_s
        self.tools = {t: TOOL_SCHEMAS[t] for t in tools}
        self.system_prompt = system_prompt(tools)
        self.grade = Grader()
        self.golds = None
        self.turn = 0

    def reset(self, row, seed):
        problem, answers = row.get("problem"), row.get("answers")
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError('row "problem" must be a non-empty string')
        if isinstance(answers, (str, int, float)) and not isinstance(answers, bool):
            answers = [answers]
        if not isinstance(answers, list) or not answers:
            raise ValueError('row "answers" must be a non-empty list')
        self.golds = [self.grade.gold(str(a)) for a in answers]
        self.turn = 0
        return [system(self.system_prompt), user(problem)], {"index": row.get("index")}

    def _run(self, name: str, args: dict) -> tuple[str, bool]:
        param = "expression" if name == "calculator" else "code"
        extra = sorted(set(args) - {param})
        if extra:
            return f"error: {name} takes one argument, {json.dumps(param)}; unexpected {extra}", False
        value = args.get(param)
        if not isinstance(value, str):
            return f"error: {name} needs {json.dumps(param)} (a string)", False
        if name == "calculator":
            return calculate(value)
        return run_python(value, self.python_timeout_s)

    def step(self, action):
        if self.golds is None:
            raise RuntimeError("step before reset")
        self.turn += 1
        text = action.get("text") or ""
        blocks, stray = find_calls(text)
        if not blocks and not stray:
            reward = self.grade(last_boxed(text), self.golds)
            self.golds = None
            return None, reward, True, {"tool_calls": 0, "tool_errors": 0, "final": True}
        messages, errors = [], 0
        for body, err in blocks[:self.max_calls]:
            if err is None:
                try:
                    name, args = parse_call(body, self.tools)
                except CallError as e:
                    err = str(e)
                else:
                    result, ok = self._run(name, args)
                    messages.append(tool(result))
                    errors += not ok
                    continue
            messages.append(tool(f"error: {err}"))
            errors += 1
        if len(blocks) > self.max_calls:
            extra = len(blocks) - self.max_calls
            messages.append(tool(f"error: {extra} more tool call(s) not run: at most {self.max_calls} "
                                 "per turn"))
            errors += extra
        for err in stray:
            messages.append(tool(f"error: {err}"))
            errors += 1
        info = {"tool_calls": len(blocks) + len(stray), "tool_errors": errors, "final": False}
        if self.turn >= self.max_turns:
            self.golds = None
            return None, 0.0, True, info
        return messages, 0.0, False, info


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m lorasync_env.tools_env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-turns", type=int, default=4, help="model turns per episode")
    p.add_argument("--tools", default=",".join(TOOL_NAMES),
                   help="comma-separated tools to offer: calculator, python")
    p.add_argument("--python-timeout-s", type=float, default=5.0,
                   help="wall-time limit of one python call (its CPU limit is this, rounded up, + 1)")
    p.add_argument("--max-calls", type=int, default=4,
                   help="tool calls run per turn (more get one error message)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    main(lambda: ToolsEnv(args.max_turns, [t.strip() for t in args.tools.split(",") if t.strip()],
                          args.python_timeout_s, args.max_calls))
