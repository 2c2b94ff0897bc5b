"""Qwen3 and Llama 3 in lorasync against Hugging Face transformers and PEFT (fp32, CPU).

The families are configuration of one decoder (core/model/decoder_model.h); these are the
transformers classes each must equal:
- random models made by `lorasync init-model --config` load in Qwen3ForCausalLM / LlamaForCausalLM
  (tied and untied, GQA and MHA, Qwen3's q/k norms and its decoupled head_dim, Llama's biases when
  attention_bias is set and its llama3 RoPE scaling, given the legacy way and as transformers 5's
  rope_parameters), and lorasync's logits and completion logprobs equal transformers' within 1e-4;
- a PEFT adapter saved on each family loads in lorasync with the same logits, and the gradient of
  the completion logprobs with respect to every LoRA A and B (`lorasync logprobs --grads-out`, the
  training path's autograd) equals PEFT's;
- `lorasync serve` (the engine's CPU decode kernels, q/k norms included) samples greedily the
  tokens transformers would, with the same logprobs;
- `lorasync init-model --arch` makes a model of each family that transformers loads;
- an unknown model_type is refused at load, naming the supported families.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import SHARED, compare_logits, random_rows, figure, lorasync, lorasync_logits, make_model, serve, torch_logits

TOL = 1e-4
GRAD_RTOL = 1e-5  # of the largest gradient (sums over many tokens reach tens; fp32 ulps scale with them)
torch.set_num_threads(2)

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
         "mlp_bias": False, "rope_theta": 500000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
    "qwen3_untied_gqa": {**QWEN3},
    "qwen3_tied_hd32": {**QWEN3, "tie_word_embeddings": True, "head_dim": 32, "rope_theta": 1e6},
    "qwen3_mha_bias": {**QWEN3, "num_key_value_heads": 4, "attention_bias": True},
    "llama_untied_gqa": {**LLAMA},
    "llama_tied_llama3_rope": {**LLAMA, "tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE},
    "llama_rope_parameters_bias": {**LLAMA, "attention_bias": True, "rope_theta": None,
                                   "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}},
}


def hf_class(model_type):
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM
    return {"qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM}[model_type]


def hf_model(path):
    cfg = json.loads((path / "config.json").read_text())
    m = hf_class(cfg["model_type"]).from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def build(tmp, case, seed=None, **extra):
    overrides = {**CASES[case], **extra}
    model = make_model(tmp, name=case, seed=seed if seed is not None else len(case),
                       **{k: v for k, v in overrides.items() if v is not None})
    if "rope_parameters" in overrides:
        # init-model read rope_parameters (transformers 5's form) and wrote the legacy keys; the
        # directory gets transformers 5's form back, so that loading reads it too.
        cfg_path = model / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("rope_theta", None)
        cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = overrides["rope_parameters"]
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return model


def rows(seed, vocab, n=3):
    return random_rows(seed, vocab, n, completion_step=9)


def write_rows(tmp, items):
    inp = tmp / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in items))
    return inp








@pytest.mark.parametrize("case", list(CASES))
def test_base_model_matches_transformers(tmp, case):
    model = build(tmp, case)
    items = rows(7, 512)
    hf = hf_model(model)
    if "rope" in case:  # the scaling is really in use: transformers' inv_freq is not the plain one
        plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
        assert not torch.allclose(hf.model.rotary_emb.inv_freq.float(), plain)
    compare_logits(f"transformers_{case}", lorasync_logits(tmp, model, items), torch_logits(hf, items))


def peft_adapter(tmp, model, targets, rank=4, alpha=16, seed=0):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                     init_lora_weights=False, bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(hf_model(model), cfg)
    out = tmp / "adapters" / "peft-v1"
    pm.save_pretrained(str(out))
    return pm, out


@pytest.mark.parametrize("case", ["qwen3_untied_gqa", "llama_tied_llama3_rope"])
def test_peft_adapter_logits_and_gradients_match(tmp, case):
    model = build(tmp, case, seed=4)
    pm, adapter = peft_adapter(tmp, model, "all-linear")
    items = rows(13, 512)
    pm.eval()
    compare_logits(f"lorasync_loads_peft_adapter_{case}", lorasync_logits(tmp, model, items, adapter), torch_logits(pm, items))

    # One step's gradients: d(sum of completion logprobs)/d(A, B), ours against PEFT's autograd.
    grads = tmp / "grads.safetensors"
    lorasync("logprobs", "--model", model, "--adapter", adapter, "--input", write_rows(tmp, items),
             "--grads-out", grads, "--threads", 2)
    mine = load_file(str(grads))
    pm.zero_grad()
    for r in items:
        logits = pm(torch.tensor([r["prompt_ids"] + r["completion_ids"]])).logits[0].float()
        P, C = len(r["prompt_ids"]), len(r["completion_ids"])
        logp = torch.log_softmax(logits[P - 1:P - 1 + C], -1)
        logp.gather(1, torch.tensor(r["completion_ids"]).unsqueeze(1)).sum().backward()
    want = {n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if "lora_" in n}
    assert set(mine) == set(want), f"gradient names differ: {sorted(set(mine) ^ set(want))[:6]}"
    worst, scale = 0.0, 0.0
    for n, g in want.items():
        worst = max(worst, (mine[n] - g).abs().max().item())
        scale = max(scale, g.abs().max().item())
    figure(f"peft_lora_gradients_{case}", worst / scale, max_abs_diff=worst, largest_gradient=scale,
           tensors=len(want), tolerance=GRAD_RTOL)
    assert scale > 1e-3, "the gradients are all near zero: nothing was checked"
    assert worst <= GRAD_RTOL * scale, f"LoRA gradients differ by {worst} (largest {scale})"


@pytest.mark.parametrize("case", ["qwen3_tied_hd32", "llama_tied_llama3_rope"])
def test_serve_greedy_matches_transformers(tmp, case):
    import urllib.request
    model = build(tmp, case, seed=6, vocab_size=151936, tokenizer=SHARED / "data" / "qwen2-tokenizer")
    srv = serve(model, "--served-model-name", "tiny")
    try:
        prompt = [5, 17, 99, 250, 3, 41, 77, 1024, 9, 31]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
                "return_token_ids": True, "ignore_eos": True}
        req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            choice = json.loads(r.read())["choices"][0]
        toks, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        with torch.no_grad():
            logits = hf_model(model)(torch.tensor([prompt + toks])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        P = len(prompt)
        want_toks = [int(logp[P - 1 + t].argmax()) for t in range(len(toks))]
        want_lps = [logp[P - 1 + t, tok].item() for t, tok in enumerate(toks)]
        d = max(abs(x - y) for x, y in zip(lps, want_lps))
        figure(f"serve_greedy_{case}", d, tokens=len(toks), tolerance=TOL)
        assert toks == want_toks, f"greedy tokens differ: ours {toks}, transformers {want_toks}"
        assert d <= TOL
    finally:
        srv.stop()


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_init_model_arch_loads_in_transformers(tmp, arch):
    out = tmp / arch
    lorasync("init-model", "--preset", "tiny", "--arch", arch, "--vocab-size", 512, "--output", out,
             "--tokenizer", "none", "--seed", 3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == ("llama" if arch == "llama3" else "qwen3")
    items = rows(3, 512, n=2)
    compare_logits(f"init_model_arch_{arch}", lorasync_logits(tmp, out, items), torch_logits(hf_model(out), items))


def test_unknown_model_type_is_refused_naming_the_supported_ones(tmp):
    model = make_model(tmp, seed=2)
    cfg = json.loads((model / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mistral", ["MistralForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    p = lorasync("logprobs", "--model", model, "--prompt-ids", "1,2", "--completion-ids", "3", check=False)
    assert p.returncode != 0
    assert "mistral" in p.stderr and "qwen3" in p.stderr and "llama" in p.stderr, p.stderr
