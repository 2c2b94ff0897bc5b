"""A plain TRL AsyncGRPOTrainer script, LoRA on, pointed at an OpenAI/vLLM-compatible endpoint.

This is what a TRL user already has; only `--server` changes (a `lorasync proxy` in front of
`lorasync serve` replicas instead of `vllm serve`). tests/conformance/test_trl_async_grpo.py runs
it on CPU; the README's "Keep your TRL script" section shows it by hand.

    python tests/conformance/trl_async/run_async_grpo.py --model DIR --server http://127.0.0.1:8000 \
        --data ../shared/data/math_sanity_1k5.jsonl --output-dir runs/trl --max-steps 3

Three things are specific to running TRL on a CPU-only machine without vLLM installed, all done
from outside TRL's code (see the test's docstring for why each is needed); on a GPU machine with
vLLM's package installed none of them is used:
  * `--cpu-attention DIR` points the `kernels` package's documented local override
    (LOCAL_KERNELS) for `kernels-community/flash-attn3` at a CPU build of `flash_attn_varlen_func`;
  * `--cpu-shims` rebinds two names TRL's modules look up: `is_vllm_available`, which the rollout
    worker checks before it starts although it never imports vLLM (it talks to the server over
    HTTP with aiohttp), and `get_peak_flops_per_device`, which asks CUDA for the device name to
    size MFU metrics and raises without a GPU (it now answers "unknown", as TRL itself does for
    devices missing from its table: MFU metrics off).
Each logged TRL metrics dict is appended as a JSON line to `<output-dir>/trl_logs.jsonl`.
"""
import argparse
import json
import os
import re
import sys
from pathlib import Path


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (config, weights, tokenizer)")
    p.add_argument("--server", required=True, help="base URL of the inference endpoint (proxy or replica)")
    p.add_argument("--data", required=True, help="JSONL of {problem, answer}")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--problems", type=int, default=16, help="first N problems of --data")
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--cpu-attention", help="directory of a CPU build of flash_attn_varlen_func (kernels' LOCAL_KERNELS)")
    p.add_argument("--cpu-shims", action="store_true",
                   help="let TRL start without vLLM installed and without a CUDA device (see above)")
    return p.parse_args()


def reward_answer(completions, answer, **kwargs):
    """1 when the last number of the completion is the reference answer, else a small shaping term
    (the completion's length in characters, so that a random policy's group still has distinct
    rewards and a gradient)."""
    rewards = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
        if numbers and numbers[-1] == str(gold).strip():
            rewards.append(1.0)
        else:
            rewards.append(0.1 * min(1.0, len(text) / 200))
    return rewards


def main():
    args = parse_args()
    if args.cpu_attention:
        os.environ["LOCAL_KERNELS"] = f"kernels-community/flash-attn3={Path(args.cpu_attention).resolve()}"

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    if args.cpu_shims:
        # vLLM 0.22-0.31 (the range TRL 1.16 supports) cannot be installed next to the pinned torch
        # 2.11 and has no CPU wheel; the rollout worker only checks that the package is present.
        import trl.experimental.async_grpo.async_grpo_trainer as grpo_trainer
        import trl.experimental.async_grpo.async_rollout_worker as rollout_worker
        rollout_worker.is_vllm_available = lambda *a, **k: True
        # torch.cuda.get_device_name() raises without a GPU; None = "peak FLOPs unknown".
        grpo_trainer.get_peak_flops_per_device = lambda *a, **k: None

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[: args.problems]]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["problem"]}], "answer": str(r["answer"])} for r in rows])

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "trl_logs.jsonl"

    class JsonLogs(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_kwargs):
            if logs:
                with log_path.open("a") as f:
                    f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

    config = AsyncGRPOConfig(
        output_dir=str(out),
        vllm_server_base_url=args.server,
        vllm_server_timeout=60,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_staleness=args.max_staleness,
        learning_rate=1e-3,
        temperature=1.0,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        dtype="float32",
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        seed=7,
    )
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=reward_answer,
        args=config,
        train_dataset=dataset,
        peft_config=LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"),
        callbacks=[JsonLogs()],
    )
    trainer.train()
    print(json.dumps({"event": "trained", "model_version": trainer.model_version,
                      "global_step": trainer.state.global_step}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
