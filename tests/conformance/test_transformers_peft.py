"""lorasync's Qwen2 and LoRA numerics against Hugging Face transformers and PEFT (fp32, CPU).

- Random models made by `lorasync init-model` (tied and untied embeddings, GQA and MHA, biases,
  other RoPE theta and head_dim) load in transformers' Qwen2ForCausalLM; lorasync's logits
  (`lorasync logprobs --logits-out`) and completion logprobs equal transformers' within 1e-4.
- Adapters written by `lorasync init-adapter` load in PEFT and give the same logits.
- Adapters saved by PEFT (`get_peft_model(...).save_pretrained`) load in `lorasync logprobs` and in
  `lorasync serve` (through /v1/load_lora_adapter), whose greedy tokens and logprobs equal PEFT's.
"""
import json

import pytest
import torch

from conftest import SHARED, compare_logits, random_rows, figure, lorasync, lorasync_logits, make_model, serve, torch_logits

TOL = 1e-4
torch.set_num_threads(2)


def hf_model(path):
    from transformers import Qwen2ForCausalLM
    m = Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    return m.eval()


def rows(seed, vocab, n=3):
    return random_rows(seed, vocab, n, completion_step=3)








CASES = {
    "untied_gqa": {},
    "tied_gqa": {"tie_word_embeddings": True},
    "untied_mha": {"num_key_value_heads": 4},
    "tied_mqa_theta1e6_hd32": {"tie_word_embeddings": True, "num_key_value_heads": 1,
                               "head_dim": 32, "rope_theta": 1e6, "hidden_size": 96},
}


@pytest.mark.parametrize("case", list(CASES))
def test_base_model_matches_transformers(tmp, case):
    model = make_model(tmp, seed=len(case), **CASES[case])
    items = rows(7, 512)
    compare_logits(f"transformers_qwen2_{case}", lorasync_logits(tmp, model, items), torch_logits(hf_model(model), items))


@pytest.mark.parametrize("case", ["untied_gqa", "tied_gqa"])
def test_lorasync_adapter_loads_in_peft(tmp, case):
    from peft import PeftModel
    model = make_model(tmp, seed=3, **CASES[case])
    adapter = tmp / "adapters" / "policy-v1"
    lorasync("init-adapter", "--model", model, "--output", adapter, "--rank", 4, "--alpha", 8,
             "--b-std", 0.2, "--seed", 5)
    items = rows(11, 512)
    peft_model = PeftModel.from_pretrained(hf_model(model), str(adapter)).eval()
    a, b = lorasync_logits(tmp, model, items, adapter), torch_logits(peft_model, items)
    compare_logits(f"peft_loads_lorasync_adapter_{case}", a, b)
    # The adapter really changes the model (a zero B would pass trivially).
    base = torch_logits(hf_model(model), items)
    delta = max((x - y).abs().max().item() for x, y in zip(b[0], base[0]))
    assert delta > 1e-3, f"the adapter changed the logits by only {delta}"


def peft_saved_adapter(tmp, model, targets, rank=4, alpha=16):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                     init_lora_weights=False, bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(hf_model(model), cfg).eval()
    out = tmp / "adapters" / "peft-v1"
    pm.save_pretrained(str(out))
    return pm, out


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_peft_saved_adapter_loads_in_lorasync(tmp, targets):
    model = make_model(tmp, seed=4)
    pm, adapter = peft_saved_adapter(tmp, model, targets)
    items = rows(13, 512)
    name = "all_linear" if targets == "all-linear" else "q_v"
    compare_logits(f"lorasync_loads_peft_adapter_{name}", lorasync_logits(tmp, model, items, adapter), torch_logits(pm, items))


def test_peft_saved_adapter_served_by_lorasync_serve(tmp):
    import urllib.request
    # serve needs a tokenizer: the real Qwen2 one (and its vocabulary size).
    model = make_model(tmp, seed=6, tokenizer=SHARED / "data" / "qwen2-tokenizer",
                       vocab_size=151936, tie_word_embeddings=True)
    pm, adapter = peft_saved_adapter(tmp, model, "all-linear", rank=8, alpha=16)
    srv = serve(model, "--served-model-name", "tiny", "--max-loras", 2, "--max-lora-rank", 8,
                "--allowed-adapter-root", tmp / "adapters")
    try:
        def post(path, body):
            req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())
        post("/v1/load_lora_adapter", {"lora_name": "peft-v1", "lora_path": str(adapter)})
        prompt = [5, 17, 99, 250, 3, 41]
        res = post("/v1/completions", {"model": "peft-v1", "prompt": prompt, "max_tokens": 8,
                                       "temperature": 0, "logprobs": 0, "return_token_ids": True,
                                       "ignore_eos": True})
        choice = res["choices"][0]
        toks, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert res["lorasync"]["adapter"] == "peft-v1"
        with torch.no_grad():
            logits = pm(torch.tensor([prompt + toks])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        P = len(prompt)
        want_toks = [int(logp[P - 1 + t].argmax()) for t in range(len(toks))]
        want_lps = [logp[P - 1 + t, tok].item() for t, tok in enumerate(toks)]
        d = max(abs(x - y) for x, y in zip(lps, want_lps))
        figure("serve_peft_adapter_greedy", d, tokens=len(toks), tolerance=TOL)
        assert toks == want_toks, f"greedy tokens differ: ours {toks}, PEFT {want_toks}"
        assert d <= TOL
    finally:
        srv.stop()
