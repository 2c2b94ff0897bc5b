"""The PyTorch baseline of `lorasync bench train --baseline pytorch` (bench/train_baseline.py) does
the same maths as lorasync and as Hugging Face's stack, so its speed is a fair reference:

- on a packed row (several samples, positions restarting per sample) its completion logprobs with
  a LoRA adapter equal `lorasync logprobs` within 1e-4, for Qwen2, Qwen3 (q/k norms) and Llama 3
  (llama3 RoPE scaling) models (`bench train --arch`);
- the gradients of a weighted sum of those logprobs with respect to every LoRA factor equal the
  gradients PEFT + transformers give for the same objective computed sample by sample.
"""
import json
import sys

import pytest
import torch

from conftest import ROOT, figure, lorasync, make_model

sys.path.insert(0, str(ROOT / "bench"))
import train_baseline as tb  # noqa: E402

TOL = 1e-4
torch.set_num_threads(2)


def samples(seed, vocab, n=4):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": torch.randint(3, vocab, (4 + 5 * i,), generator=g).tolist(),
             "completion": torch.randint(3, vocab, (3 + 4 * i,), generator=g).tolist()} for i in range(n)]


def baseline_model(model_dir, adapter_dir, rank, alpha):
    cfg = json.loads((model_dir / "config.json").read_text())
    m = tb.Model(cfg, tb.load_weights(str(model_dir)), rank, alpha, seed=1)
    tb.load_adapter(m, str(adapter_dir))
    return m


FAMILIES = {
    "qwen2": {},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False},
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
              "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_baseline_logprobs_equal_lorasync_on_a_packed_row(tmp, family):
    model = make_model(tmp, seed=3, **FAMILIES[family])
    adapter = tmp / "adapters" / "a"
    lorasync("init-adapter", "--model", model, "--output", adapter, "--rank", 4, "--alpha", 8,
             "--b-std", 0.2, "--seed", 5)
    items = samples(7, 512)
    inp = tmp / "rows.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": s["prompt"], "completion_ids": s["completion"]}) + "\n"
                           for s in items))
    p = lorasync("logprobs", "--model", model, "--adapter", adapter, "--input", inp, "--threads", 2)
    ours = [x for line in p.stdout.splitlines() if line.strip() for x in json.loads(line)["logprobs"]]
    m = baseline_model(model, adapter, 4, 8.0)
    with torch.no_grad():
        lp, _ = tb.row_logprobs(m, tb.prepare(items), chunk=5)
    diff = (lp - torch.tensor(ours, dtype=lp.dtype)).abs().max().item()
    figure(f"train_baseline_logprobs_vs_lorasync_{family}", diff, tolerance=TOL)
    assert diff <= TOL, f"baseline logprobs differ from lorasync's by {diff}"


def test_baseline_lora_gradients_equal_peft(tmp):
    from peft import PeftModel
    from transformers import Qwen2ForCausalLM
    model = make_model(tmp, seed=4, tie_word_embeddings=True)
    adapter = tmp / "adapters" / "a"
    lorasync("init-adapter", "--model", model, "--output", adapter, "--rank", 2, "--alpha", 4,
             "--b-std", 0.2, "--seed", 6)
    items = samples(9, 512)
    weights = torch.linspace(-1, 1, sum(len(s["completion"]) for s in items), dtype=torch.float64)

    m = baseline_model(model, adapter, 2, 4.0)
    lp, _ = tb.row_logprobs(m, tb.prepare(items), chunk=4)
    (lp.double() * weights).sum().backward()

    hf = Qwen2ForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32, attn_implementation="eager")
    pm = PeftModel.from_pretrained(hf, str(adapter), is_trainable=True)
    off = 0
    for s in items:
        ids = torch.tensor([s["prompt"] + s["completion"]])
        logp = torch.log_softmax(pm(ids).logits[0].float(), -1)
        P, T = len(s["prompt"]), len(s["completion"])
        tok = torch.tensor(s["completion"])
        sel = logp[torch.arange(P - 1, P - 1 + T), tok]
        (sel.double() * weights[off:off + T]).sum().backward()
        off += T
    params = dict(pm.named_parameters())
    worst, n = 0.0, 0
    for (l, mod), (a, b) in m.lora.items():
        part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        for ab, ours in (("A", a), ("B", b)):
            ref = params[f"base_model.model.model.layers.{l}.{part}.{mod}.lora_{ab}.default.weight"].grad
            scale = ref.abs().max().item()
            assert scale > 0, f"layer {l} {mod} lora_{ab}: no gradient"
            worst = max(worst, (ours.grad - ref).abs().max().item() / scale)
            n += 1
    figure("train_baseline_lora_grads_vs_peft", worst, tensors=n, tolerance=TOL)
    assert worst <= TOL, f"baseline LoRA gradients differ from PEFT's by {worst} (relative)"
