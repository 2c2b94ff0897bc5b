#!/usr/bin/env python3
"""Stub replicas in Python for `lorasync bench proxy --stubs python` (stdlib only).

Serves N fake replicas on one asyncio event loop (as the C++ stubs' shared thread), answering
/v1/completions as `lorasync serve` does for the request (bench/proxy/completion_body.h: n choices
of max_tokens tokens each, with logprobs and token ids when asked; the request parsed with json and
the answer written with json.dumps, as a Python server would), and /health, /v1/models,
/reset_prefix_cache and anything else with a small JSON object. Prints `ports P1 P2 ...` once
listening. The generated tokens come from --table, written by the bench from the C++ stubs' table.

    py_stubs.py --table TABLE.json --replicas 2
"""

import argparse
import asyncio
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", required=True)
    ap.add_argument("--replicas", type=int, default=2)
    args = ap.parse_args()
    table = json.load(open(args.table))
    tokens = [(int(i), t) for i, t in table["tokens"]]
    logprobs = [float(x) for x in table["logprobs"]]
    nt, nl = len(tokens), len(logprobs)
    counter = [0]

    def render(req, index):
        model = str(req.get("model", ""))
        prompt = req.get("prompt")
        ids = prompt if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt) else []
        n = int(req.get("n", 1) or 1)
        T = int(req.get("max_tokens", 16) or 16)
        want_lp = isinstance(req.get("logprobs"), int) and not isinstance(req.get("logprobs"), bool)
        want_ids = req.get("return_token_ids") is True
        counter[0] += 1
        seed = counter[0] * 2654435761 + index
        choices = []
        for c in range(n):
            start, lstart = (seed + 977 * c) % nt, (seed // 7 + 131 * c) % nl
            toks = [tokens[(start + k) % nt] for k in range(T)]
            texts = [t for _, t in toks]
            ch = {"index": c, "finish_reason": "length", "text": "".join(texts)}
            if want_lp:
                offs, off = [], 0
                for t in texts:
                    offs.append(off)
                    off += len(t.encode())
                ch["logprobs"] = {"tokens": texts, "token_logprobs": [logprobs[(lstart + 7 * k) % nl] for k in range(T)],
                                  "top_logprobs": None, "text_offset": offs}
            else:
                ch["logprobs"] = None
            if want_ids:
                ch["token_ids"] = [i for i, _ in toks]
                ch["prompt_token_ids"] = ids
            choices.append(ch)
        base = model in ("m", "base")
        out = {"id": "cmpl-stub%d-%d" % (index, counter[0]), "object": "text_completion", "created": 1767225600,
               "model": model, "choices": choices,
               "usage": {"prompt_tokens": len(ids), "completion_tokens": n * T, "total_tokens": len(ids) + n * T,
                         "cached_prompt_tokens": 0, "prompt_tokens_details": {"cached_tokens": 0}},
               "lorasync": {"adapter": None if base else model, "adapter_sha256": None if base else "a" * 64,
                            "base_model_sha256": "b" * 64}}
        return json.dumps(out, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    async def serve(reader, writer, index):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                target = lines[0].split(b" ")[1]
                clen = 0
                for line in lines[1:]:
                    if line[:15].lower() == b"content-length:":
                        clen = int(line[15:])
                body = await reader.readexactly(clen) if clen else b""
                path = target.split(b"?")[0]
                status = b"200 OK"
                if path in (b"/v1/completions", b"/v1/chat/completions"):
                    try:
                        out = render(json.loads(body), index)
                    except Exception as e:  # noqa: BLE001 (any bad request is a 400)
                        status, out = b"400 Bad Request", json.dumps({"error": {"message": str(e)}}).encode()
                elif path == b"/v1/models":
                    out = b'{"object":"list","data":[{"id":"base","object":"model"}]}'
                else:
                    out = b'{"status":"ok"}'
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: " +
                             str(len(out)).encode() + b"\r\nX-Stub-Index: " + str(index).encode() + b"\r\n\r\n" + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def run():
        servers = []
        for i in range(args.replicas):
            servers.append(await asyncio.start_server(lambda r, w, i=i: serve(r, w, i), "127.0.0.1", 0, backlog=1024))
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        print("ports " + " ".join(str(p) for p in ports), flush=True)
        await asyncio.gather(*(s.serve_forever() for s in servers))

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
