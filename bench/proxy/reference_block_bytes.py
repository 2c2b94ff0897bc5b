#!/usr/bin/env python3
"""bench/proxy/reference_block_bytes.py: the reference proxy's memory per tracked block, measured,
for `lorasync bench proxy --reference` (its `bytes_per_tracked_block` baseline, beside ours in the
same run). Python standard library only, plus what the reference itself imports.

  python3 reference_block_bytes.py REFERENCE.py ENTRIES

Loads the reference (the HF Python proxy's lora_proxy.py) as a module, so its `__main__` block does
not run, builds its router (`PrefixRouter(Config(env), 2)`, the table bounded at ENTRIES), and sends
distinct token-id prompts of 64 blocks through `choose()` until its table (`router.blocks`) holds
ENTRIES blocks. The bytes are those of the table as it then stands: `sys.getsizeof` of the table and
of every object reachable from it (keys, entries, owner and successor sets, their members), each
object once, as `BlockTable::memory_bytes()` counts ours' slab and index (allocator overhead left
out on both sides; tracemalloc over the filling gave the same figure within 0.1 B at 20k blocks,
at twenty times the time). Prints one JSON object: {"entries", "bytes", "bytes_per_block",
"method", "seconds"}; on failure, a message on stderr and exit status 1.
"""
import importlib.util
import json
import sys
import time


def reachable_bytes(table):
    """sys.getsizeof of `table` and of every object reachable from it through containers, each once."""
    seen = {id(table)}
    total = sys.getsizeof(table)
    stack = [table]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            children = [*o.keys(), *o.values()]
        elif isinstance(o, (list, tuple, set, frozenset)):
            children = list(o)
        else:
            continue
        for c in children:
            if id(c) not in seen:
                seen.add(id(c))
                total += sys.getsizeof(c)
                stack.append(c)
    return total


def main():
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    path, entries = sys.argv[1], int(sys.argv[2])
    spec = importlib.util.spec_from_file_location("reference_proxy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    env = {"UPSTREAM_URLS": "http://127.0.0.1:1,http://127.0.0.1:2", "PROXY_MAX_TRACKED_BLOCKS": str(entries),
           "HF_TOKEN": "bench"}
    cfg = mod.Config(env)
    block = int(getattr(cfg, "block_size", 16))
    per_prompt = 64  # blocks per prompt; each prompt's first token is its own, so no block repeats
    ups = [mod.Upstream(i, u) for i, u in enumerate(cfg.upstreams)]
    t0 = time.perf_counter()
    router = mod.PrefixRouter(cfg, len(ups))
    p = 0
    while len(router.blocks) < entries:
        left = entries - len(router.blocks)
        n = min(per_prompt, left)
        prompt = [1_000_000 + p] + [(p * 7919 + k) % 150_000 for k in range(n * block - 1)]
        router.choose(ups, "policy", prompt)
        p += 1
    used = reachable_bytes(router.blocks)
    held = len(router.blocks)
    print(json.dumps({"entries": held, "bytes": used, "bytes_per_block": used / max(1, held),
                      "method": "sys.getsizeof of the table and every object reachable from it, each once",
                      "seconds": time.perf_counter() - t0}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # noqa: BLE001 - any failure is reported, the bench goes on without the figure
        sys.stderr.write(f"reference_block_bytes: {type(e).__name__}: {e}\n")
        sys.exit(1)
