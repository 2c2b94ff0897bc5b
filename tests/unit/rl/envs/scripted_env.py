#!/usr/bin/env python3
"""A scripted environment for the C++ tests of rl/environment.h and rl/episode.h (protocol v1).

Stdlib only. argv: --mode MODE. Modes:
  ok           two model turns: reset -> "say yes"; step 1 -> another user message ("again"),
               reward 0.25; step 2 -> done, reward 1.0 when the turn's text contains "yes", else 0.
               info echoes how many token ids the step received.
  tokens       like ok, but the second observation is given as token ids [11, 12, 13].
  garbage      prints a line that is not JSON on reset.
  huge         answers reset with a 50 MB observation (one line).
  never_done   every step answers done = false with another message.
  crash_step   exits with status 3 on the first step.
  hang         sleeps an hour on the first step.
  wrong_id     answers reset with the wrong id.
  error        answers the first step with {"error": ...}.
  overflow     the first step's observation is 100,000 words.
  bad_token    the first step's observation holds token id -5.
Every started process appends its pid to $SCRIPTED_ENV_PIDS when set (to count workers).
"""
import json
import os
import sys
import time


def main():
    mode = sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "ok"
    pids = os.environ.get("SCRIPTED_ENV_PIDS")
    if pids:
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
    out = sys.stdout
    turn = 0

    def send(obj):
        out.write(json.dumps(obj) + "\n")
        out.flush()

    for line in sys.stdin:
        req = json.loads(line)
        rid = req["id"]
        if req.get("lorasync_env") != 1:
            send({"id": rid, "error": "only protocol 1"})
            continue
        if req["op"] == "reset":
            turn = 0
            if mode == "garbage":
                out.write("this is not json\n")
                out.flush()
                continue
            if mode == "huge":
                send({"id": rid, "observation": {"messages": [{"role": "user", "content": "x" * (50 << 20)}]}, "done": False})
                continue
            if mode == "wrong_id":
                send({"id": rid + 1, "observation": {"messages": [{"role": "user", "content": "hi"}]}, "done": False})
                continue
            row = req.get("row", {})
            send({"id": rid, "observation": {"messages": [{"role": "system", "content": "Answer yes."},
                                                          {"role": "user", "content": f"say yes to {row.get('problem', '')}"}]},
                  "done": False, "info": {"seed": req.get("seed")}})
            continue
        if req["op"] != "step":
            send({"id": rid, "error": "unknown op " + str(req["op"])})
            continue
        turn += 1
        action = req["action"]
        info = {"n_ids": len(action["token_ids"]), "finish": action["finish_reason"]}
        if mode == "crash_step":
            os._exit(3)
        if mode == "hang":
            time.sleep(3600)
        if mode == "error":
            send({"id": rid, "error": "the environment failed (scripted)"})
            continue
        if mode == "overflow" and turn == 1:
            send({"id": rid, "observation": {"messages": [{"role": "user", "content": "word " * 100000}]}, "reward": 0.5,
                  "done": False})
            continue
        if mode == "bad_token" and turn == 1:
            send({"id": rid, "observation": {"token_ids": [1, -5]}, "reward": 0, "done": False})
            continue
        if mode == "never_done" or turn == 1:
            obs = {"token_ids": [11, 12, 13]} if mode == "tokens" else {"messages": [{"role": "user", "content": "again"}]}
            send({"id": rid, "observation": obs, "reward": 0.25, "done": False, "info": info})
            continue
        send({"id": rid, "observation": None, "reward": 1.0 if "yes" in action["text"] else 0.0, "done": True, "info": info})


if __name__ == "__main__":
    main()
