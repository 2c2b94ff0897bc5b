"""bench/train_baseline.py and `lorasync bench train --baseline pytorch` train the same rows: the
rows file `bench train` writes carries a checksum that the script recomputes (FNV-1a over the
lengths and token ids, written the same way on both sides) and a file whose rows disagree with it
is refused; the script's block-diagonal-mask attention gives the per-sample attention's logprobs;
a step (forward, loss, backward, clip, AdamW) reports its parts. Nothing here is timed."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import train_baseline as tb  # noqa: E402

torch.set_num_threads(1)


def rows_of(seed, n_rows=2, per_row=3, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [[{"prompt": torch.randint(0, vocab, (2 + i,), generator=g).tolist(),
              "completion": torch.randint(0, vocab, (1 + 2 * i,), generator=g).tolist()}
             for i in range(per_row)] for _ in range(n_rows)]


def test_checksum_pins_lengths_and_ids():
    # The empty set: FNV-1a of the single value 0 (the row count).
    assert tb.rows_checksum([]) == f"{(0xcbf29ce484222325 * 0x100000001b3) & ((1 << 64) - 1):016x}"
    rows = rows_of(1)
    base = tb.rows_checksum(rows)
    moved = json.loads(json.dumps(rows))  # one token moved from the prompt to the completion
    moved[0][0]["completion"].insert(0, moved[0][0]["prompt"].pop())
    assert tb.rows_checksum(moved) != base
    other = json.loads(json.dumps(rows))
    other[1][2]["completion"][0] += 1
    assert tb.rows_checksum(other) != base
    split = [rows[0][:2], rows[0][2:] + rows[1]]  # the same samples packed otherwise
    assert tb.rows_checksum(split) != base


def test_read_rows_refuses_a_wrong_checksum(tmp_path):
    rows = rows_of(2)
    f = tmp_path / "rows.json"
    f.write_text(json.dumps({"rows": rows, "denominator": 10.0, "checksum": tb.rows_checksum(rows)}))
    assert tb.read_rows(f)["checksum"] == tb.rows_checksum(rows)
    rows[0][0]["prompt"][0] += 1
    f.write_text(json.dumps({"rows": rows, "denominator": 10.0, "checksum": tb.rows_checksum(rows_of(2))}))
    with pytest.raises(ValueError, match="checksum"):
        tb.read_rows(f)


def test_bench_train_writes_rows_the_script_accepts(tmp_path):
    binary = os.environ.get("LORASYNC_BINARY")
    if not binary:
        pytest.skip("LORASYNC_BINARY is not set (ctest sets it)")
    f = tmp_path / "rows.json"
    subprocess.run([binary, "bench", "train", "--preset", "tiny", "--samples", "6", "--prompt-tokens", "5",
                    "--max-completion", "9", "--row-tokens", "32", "--write-rows", str(f)], check=True,
                   capture_output=True)
    spec = json.loads(f.read_text())
    assert tb.read_rows(f)["checksum"] == spec["checksum"]  # ours (C++) and the script's agree
    assert len(spec["rows"]) >= 2 and sum(len(r) for r in spec["rows"]) == 6
    assert tb.row_counts(spec) == (spec["tokens_per_step"], spec["completion_tokens_per_step"])


def tiny_model(attention):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
           "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(97, 32, generator=g) * 0.1, "model.norm.weight": torch.ones(32)}
    shapes = {"q_proj": (32, 32), "k_proj": (16, 32), "v_proj": (16, 32), "o_proj": (32, 32),
              "gate_proj": (48, 32), "up_proj": (48, 32), "down_proj": (32, 48)}
    for l in range(2):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = torch.ones(32)
        w[p + "post_attention_layernorm.weight"] = torch.ones(32)
        for m, s in shapes.items():
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            w[f"{p}{part}.{m}.weight"] = torch.randn(*s, generator=g) * 0.1
    m = tb.Model(cfg, w, 2, 4.0, seed=1, attention=attention)
    with torch.no_grad():
        for _, b in m.lora.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return m


def test_mask_attention_equals_per_sample_attention():
    row = tb.prepare(rows_of(3)[0])
    with torch.no_grad():
        seg, _ = tb.row_logprobs(tiny_model("segments"), row, chunk=4)
        mask, _ = tb.row_logprobs(tiny_model("mask"), row, chunk=4)
    assert (seg - mask).abs().max().item() < 1e-5


def test_a_step_reports_its_parts_and_moves_the_adapter():
    m = tiny_model("segments")
    params = m.parameters()
    before = [p.detach().clone() for p in params]
    rows = [tb.prepare(r) for r in rows_of(4)]
    s = tb.train_step(m, rows, 4, 10.0, tb.make_optimizer(params), params)
    assert set(s) == {"fwd_bwd_s", "opt_s", "minflt", "majflt"}
    assert all(p.grad is None for p in params)  # zero_grad(set_to_none) after the step
    assert any((p.detach() != b).any() for p, b in zip(params, before))
