"""Worker side of lorasync's multi-turn environment protocol (docs/environments.md).

`protocol` is stdlib only; the adapters (`reasoning_gym_env`, `verifiers_env`) and the built-in
tool-using maths environment (`tools_env`, math-verify) import their libraries when run, e.g.
`python -m lorasync_env.reasoning_gym_env --task chain_sum` with PYTHONPATH=<repo>/python.
"""

from .protocol import (VERSION, Environment, ProtocolError, Session, handle, main,
                       normalize_observation, serve, system, tool, user)

__all__ = ["VERSION", "Environment", "ProtocolError", "Session", "handle", "main",
           "normalize_observation", "serve", "system", "tool", "user"]
