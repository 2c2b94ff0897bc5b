"""bench/llamacpp_compare.py reads llama.cpp's benchmark outputs and summarises the rounds as it
says: llama-bench's per-repetition samples (best of them, not its mean), llama-batched-bench's JSON
lines (best of N runs), the order of the two sides swapped every round, per-round ratios and their
median. Synthetic outputs only: llama.cpp is never built here."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import llamacpp_compare as lc  # noqa: E402


def test_self_test():
    lc.self_test()


def test_llama_bench_takes_the_best_repetition_not_the_mean():
    out = ('[{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 500.0, '
           '"samples_ns": [1024000000, 512000000]}]')
    assert lc.best_of([{("prefill", 1): lc.parse_llama_bench(out, 512)}]) == {("prefill", 1): 1000.0}


def test_rounds_alternate_the_first_side():
    order = []
    lc.alternate(4, lambda: order.append("ours") or {"k": 1.0}, lambda: order.append("theirs") or {"k": 1.0})
    assert order[0::2] == ["ours", "theirs", "ours", "theirs"]
