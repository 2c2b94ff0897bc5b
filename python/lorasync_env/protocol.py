"""lorasync environment protocol v1: the worker side (stdlib only).

A worker reads one JSON request per line on stdin and writes one JSON answer per line on stdout
(docs/environments.md). `serve(make_env)` runs that loop around an `Environment`:

    class Env(Environment):
        def reset(self, row, seed):            # -> (observation, info)
            return [user(row["problem"])], {}
        def step(self, action):                # -> (observation | None, reward, done, info)
            return None, 1.0, True, {}

    serve(Env)

An observation is a list of messages (`{"role": "system"|"user"|"tool", "content": str}`), a str
(one user message), `{"messages": [...]}` or `{"token_ids": [...]}`. The action is the request's
dict: `{"text": str, "token_ids": [int], "finish_reason": "stop"|"length"}`.

Robustness: stdout's file descriptor is kept for the protocol and fd 1 / `sys.stdout` are pointed
at stderr while the worker runs, so a stray print() (Python or C) lands in the log, not in the
stream; an exception raised by the environment becomes `{"id": .., "error": ..}` and the worker
keeps serving; every answer is flushed as it is written.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from typing import Any, Callable, Iterable

VERSION = 1
OPS = ("reset", "step")
ROLES = ("system", "user", "tool")

__all__ = ["VERSION", "Environment", "ProtocolError", "serve", "handle", "Session",
           "user", "system", "tool", "normalize_observation"]


class ProtocolError(Exception):
    """A request the worker cannot answer (bad version, op, field or sequence)."""


class Environment:
    """Base class of a multi-turn environment; one instance runs one episode at a time.

    `reset` starts a new episode (discarding the previous one) and returns
    `(observation, info)`; `step` takes the model's turn and returns
    `(observation or None, reward, done, info)`. The episode's reward is the sum of the step
    rewards. Raise any exception to fail the episode (the worker answers with "error").
    """

    def reset(self, row: dict, seed: int) -> tuple[Any, dict]:
        raise NotImplementedError

    def step(self, action: dict) -> tuple[Any, float, bool, dict]:
        raise NotImplementedError

    def close(self) -> None:
        """Called once when the worker's input ends."""


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def system(content: str) -> dict:
    return {"role": "system", "content": content}


def tool(content: str) -> dict:
    return {"role": "tool", "content": content}


def normalize_observation(obs: Any) -> dict:
    """The wire form of an observation; raises ValueError for anything else."""
    if isinstance(obs, str):
        return {"messages": [user(obs)]}
    if isinstance(obs, (list, tuple)):
        obs = {"messages": list(obs)}
    if not isinstance(obs, dict):
        raise ValueError(f"observation must be messages, a str or a dict, not {type(obs).__name__}")
    if "messages" in obs and "token_ids" not in obs:
        messages = obs["messages"]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("observation.messages must be a non-empty list")
        out = []
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError('each message must be {"role": "system"|"user"|"tool", "content": str}, '
                                 f"got {str(m)[:200]}")
            out.append({"role": m["role"], "content": m["content"]})
        return {"messages": out}
    if "token_ids" in obs and "messages" not in obs:
        ids = obs["token_ids"]
        if (not isinstance(ids, (list, tuple)) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise ValueError("observation.token_ids must be a non-empty list of non-negative ints")
        return {"token_ids": list(ids)}
    raise ValueError('observation must have exactly one of "messages" or "token_ids"')


def _info(info: Any) -> dict:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise ValueError(f"info must be a dict, not {type(info).__name__}")
    return info


def _reward(r: Any) -> float:
    if r is None:
        return 0.0
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise ValueError(f"reward must be a number, not {type(r).__name__}")
    r = float(r)
    if not math.isfinite(r):
        raise ValueError(f"reward must be finite, got {r}")
    return r


class Session:
    """The protocol state of one worker: answers requests (dicts) with answers (dicts)."""

    def __init__(self, env: Environment):
        self.env = env
        self.active = False  # an episode was reset and is not done yet

    def answer(self, req: Any) -> dict:
        rid = req.get("id") if isinstance(req, dict) else None
        if isinstance(rid, bool) or not isinstance(rid, int):
            rid = None
        try:
            return self._answer(req, rid)
        except ProtocolError as e:
            return {"id": rid, "error": str(e)}
        except Exception as e:  # the environment's own failure: the episode fails, the worker stays
            self.active = False
            traceback.print_exc(file=sys.stderr)
            return {"id": rid, "error": f"{type(e).__name__}: {e}"[:4000]}

    def _answer(self, req: Any, rid: int | None) -> dict:
        if not isinstance(req, dict):
            raise ProtocolError("request must be a JSON object")
        version = req.get("lorasync_env")
        if version != VERSION:
            raise ProtocolError(f"unsupported lorasync_env version {json.dumps(version)}; supported: {VERSION}")
        if rid is None:
            raise ProtocolError('request needs an integer "id"')
        op = req.get("op")
        if op == "reset":
            row, seed = req.get("row"), req.get("seed", 0)
            if not isinstance(row, dict):
                raise ProtocolError('reset needs "row" (an object)')
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise ProtocolError('reset needs an integer "seed"')
            self.active = False
            result = self.env.reset(row, seed)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise ValueError("reset must return (observation, info)")
            obs, info = result
            answer = {"id": rid, "observation": normalize_observation(obs), "done": False, "info": _info(info)}
            self.active = True
            return answer
        if op == "step":
            action = req.get("action")
            if not isinstance(action, dict) or not isinstance(action.get("text", ""), str):
                raise ProtocolError('step needs "action" (an object with "text")')
            if not self.active:
                raise ProtocolError("step without an active episode: send reset first")
            result = self.env.step(action)
            if not (isinstance(result, tuple) and len(result) == 4):
                raise ValueError("step must return (observation, reward, done, info)")
            obs, reward, done, info = result
            if not isinstance(done, bool):
                raise ValueError(f"done must be a bool, not {type(done).__name__}")
            answer = {"id": rid, "observation": None if done else normalize_observation(obs),
                      "reward": _reward(reward), "done": done, "info": _info(info)}
            self.active = not done
            return answer
        raise ProtocolError(f"unknown op {json.dumps(op)}; supported: {', '.join(OPS)}")


def handle(session: Session, line: bytes | str) -> str:
    """One request line in, one answer line (with its newline) out."""
    try:
        req = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        answer = {"id": None, "error": f"request is not JSON: {e}"}
    else:
        answer = session.answer(req)
    try:
        text = json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:  # e.g. info that JSON cannot carry
        session.active = False
        text = json.dumps({"id": answer.get("id"), "error": f"answer is not JSON-serialisable: {e}"})
    return text + "\n"


def _protocol_streams() -> tuple[Any, Any]:
    """Keep the real stdout for answers and point fd 1 and sys.stdout at stderr."""
    sys.stdout.flush()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return sys.stdin.buffer, os.fdopen(out_fd, "wb")


def serve(make_env: Callable[[], Environment], stdin: Iterable[bytes] | None = None,
          stdout: Any = None) -> int:
    """Run the worker loop until stdin ends. `make_env` is called once (with stray output already
    going to stderr); if it raises, the worker exits with status 2. Returns the exit status."""
    if stdin is None or stdout is None:
        stdin, stdout = _protocol_streams()
    try:
        env = make_env()
    except Exception:
        traceback.print_exc(file=sys.stderr)
        print("lorasync_env: could not create the environment", file=sys.stderr)
        return 2
    session = Session(env)
    try:
        for line in stdin:
            if not line.strip():
                continue
            data = handle(session, line).encode("utf-8")
            stdout.write(data)
            stdout.flush()
    except BrokenPipeError:
        return 0
    finally:
        try:
            env.close()
        except Exception:
            traceback.print_exc(file=sys.stderr)
    return 0


def main(make_env: Callable[[], Environment]) -> None:
    """`serve` then exit with its status: the body of an adapter's `if __name__ == "__main__"`."""
    sys.exit(serve(make_env))
