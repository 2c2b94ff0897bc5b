#!/usr/bin/env python3
"""The TRL side of `lorasync bench e2e` (time to accuracy, docs/benchmarks.md).

A plain TRL GRPO script, LoRA on, as a TRL user writes it, in one of two modes:

  --mode async   TRL's AsyncGRPOTrainer (trl.experimental.async_grpo) against an OpenAI/vLLM-style
                 endpoint (`--server`: the same `lorasync proxy` + 2 `lorasync serve` fleet that
                 `lorasync train` uses in the same bench run);
  --mode sync    TRL's GRPOTrainer with its own generation (transformers `generate`, no server):
                 the plain baseline.

Both train on the same problems, with the same reward (1 when the last \\boxed{} of the completion
is the reference answer by Math-Verify, else 0; lorasync's `math_boxed`), group size, samples per
step, learning rate, LoRA rank/alpha/targets, maximum completion length and temperature as the
lorasync run they are compared with (`bench e2e` passes them). Nothing in TRL is changed; on a
CPU-only machine the async trainer needs the three outside helpers that
tests/conformance/trl_async/run_async_grpo.py explains (a CPU `flash_attn_varlen_func` through the
`kernels` package's LOCAL_KERNELS override, and two rebound names).

What it writes under --output-dir, for the bench to read:
  timeline.jsonl   {"event": "start", "time": T0} first (T0 = before `import torch`), then
                   {"event": "adapter", "step", "time", "dir", "save_s"} for every adapter
                   snapshot (every --save-steps optimizer steps, and the last step), then
                   {"event": "log", "step", "time", ...TRL's logged metrics} for every log, and
                   {"event": "end", "time", "steps", "peak_rss_mb"} at the end.
  adapters/step-N  PEFT adapter directories (save_pretrained), evaluated by the bench afterwards.
Training stops at --max-steps or when --max-seconds of wall time have passed since T0 (checked
after every step), whichever comes first.
"""
import time

T0 = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
CPU_KERNEL = HERE.parent / "tests" / "conformance" / "trl_async" / "cpu_flash_attn"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["async", "sync"], required=True)
    p.add_argument("--model", help="Hugging Face model directory (config, weights, tokenizer)")
    p.add_argument("--prepare-model", metavar="SRC",
                   help="only write OUTPUT_DIR/model: SRC's files with Qwen2.5's chat template, checked to render "
                        "the prompts lorasync trains on (ChatML), then exit")
    p.add_argument("--data", required=True, help="JSONL of {problem, answer}")
    p.add_argument("--system-prompt", default="")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--server", help="--mode async: base URL of the endpoint (proxy or replica)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--samples-per-step", type=int, default=32, help="completions per optimizer step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-staleness", type=int, default=4, help="--mode async: in optimizer steps (TRL's unit)")
    p.add_argument("--weight-sync-steps", type=int, default=2, help="--mode async")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this wall time since start (0 = no limit)")
    p.add_argument("--save-steps", type=int, default=4, help="adapter snapshot every N steps")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default: all cores)")
    return p.parse_args()


def last_boxed(text):
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def reward_math_boxed(completions, answer, **_kwargs):
    """lorasync's `math_boxed`: 1 when the last \\boxed{} is the reference answer by Math-Verify.
    Module-level: TRL's async rollout worker pickles it into a spawned process."""
    from math_verify import parse, verify
    out = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        got = last_boxed(text)
        ok = False
        if got is not None:
            # No signal-based timeouts: TRL may score off the main thread.
            gold_p = parse(f"${gold}$", parsing_timeout=None)
            got_p = parse(f"${got}$", parsing_timeout=None)
            ok = bool(gold_p and got_p and verify(gold_p, got_p, timeout_seconds=None))
        out.append(1.0 if ok else 0.0)
    return out


def prepare_model(args):
    """OUTPUT_DIR/model: links to SRC's files, and a tokenizer_config.json with the chat template
    TRL ships for Qwen2.5 (TRL's rollout worker picks its response parser by recognising the
    template). With a system message it renders exactly ChatML, which the check below holds it to."""
    import trl
    from transformers import AutoTokenizer
    src, dst = Path(args.prepare_model).resolve(), Path(args.output_dir) / "model"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "tokenizer_config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tmp = dst / "tokenizer_config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2))
    os.replace(tmp, dst / "tokenizer_config.json")
    tok = AutoTokenizer.from_pretrained(str(dst))
    for line in Path(args.data).read_text().splitlines()[:20]:
        q = json.loads(line)["problem"]
        msgs = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + \
            [{"role": "user", "content": q}]
        got = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        sys_part = f"<|im_start|>system\n{args.system_prompt}<|im_end|>\n" if args.system_prompt else ""
        want = f"{sys_part}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        if not args.system_prompt:
            want = got if got.endswith(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") else want
        if got != want:
            raise SystemExit(f"the chat template renders {got!r}, lorasync trains on {want!r}")
    return 0


def main():
    args = parse_args()
    if args.prepare_model:
        return prepare_model(args)
    if not args.model:
        raise SystemExit("--model is required (unless --prepare-model)")
    out = Path(args.output_dir)
    (out / "adapters").mkdir(parents=True, exist_ok=True)
    timeline = (out / "timeline.jsonl").open("a", buffering=1)

    def record(event, t=None, **fields):
        timeline.write(json.dumps({"event": event, "time": time.time() if t is None else t, **fields}) + "\n")

    record("start", t=T0, mode=args.mode)
    if args.mode == "async":
        os.environ["LOCAL_KERNELS"] = f"kernels-community/flash-attn3={CPU_KERNEL}"

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cpu = not torch.cuda.is_available()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    prompt = (lambda q: [{"role": "system", "content": args.system_prompt}, {"role": "user", "content": q}]) \
        if args.system_prompt else (lambda q: [{"role": "user", "content": q}])
    dataset = Dataset.from_list([{"prompt": prompt(r["problem"]), "answer": str(r["answer"])} for r in rows])
    peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                             target_modules=args.targets.split(","), task_type="CAUSAL_LM")

    class Snapshots(TrainerCallback):
        def _save(self, state, model):
            t = time.time()  # the step's end, as lorasync's snapshots are stamped
            d = out / "adapters" / f"step-{state.global_step}"
            if d.exists():
                return
            model.save_pretrained(str(d))
            record("adapter", t=t, step=state.global_step, dir=str(d), save_s=time.time() - t)

        def on_step_end(self, _args, state, control, model=None, **_kwargs):
            if state.global_step % args.save_steps == 0:
                self._save(state, model)
            if args.max_seconds > 0 and time.time() - T0 >= args.max_seconds:
                control.should_training_stop = True
            return control

        def on_train_end(self, _args, state, _control, model=None, **_kwargs):
            if model is not None and state.global_step > 0:
                self._save(state, model)

        def on_log(self, _args, state, _control, logs=None, **_kwargs):
            if logs:
                fields = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and k not in ("event", "time", "t")}
                fields["step"] = state.global_step
                record("log", **fields)

    common = dict(
        output_dir=str(out / "trl"), max_steps=args.max_steps, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, learning_rate=args.lr, temperature=args.temperature,
        use_cpu=cpu, bf16=not cpu, gradient_checkpointing=False, save_strategy="no", report_to="none",
        logging_steps=1, seed=args.seed, lr_scheduler_type="constant")
    if args.mode == "async":
        import trl.experimental.async_grpo.async_grpo_trainer as grpo_trainer
        import trl.experimental.async_grpo.async_rollout_worker as rollout_worker
        from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
        if cpu:
            # See tests/conformance/trl_async/run_async_grpo.py: the worker checks that the vllm
            # package is installed (it only talks HTTP), and the MFU sizing asks CUDA for a name.
            rollout_worker.is_vllm_available = lambda *a, **k: True
            grpo_trainer.get_peak_flops_per_device = lambda *a, **k: None
        config = AsyncGRPOConfig(
            **common, vllm_server_base_url=args.server, vllm_server_timeout=120,
            per_device_train_batch_size=args.samples_per_step, max_staleness=args.max_staleness,
            weight_sync_steps=args.weight_sync_steps, dtype="float32",
            # A step trains --samples-per-step samples, as the other systems' steps do. TRL's default
            # (a token budget of the server's max_model_len per step) trains what fits in one row:
            # 12-22 of the demo's samples against a 512-token context.
            token_budget=0)
        trainer = AsyncGRPOTrainer(model=args.model, reward_funcs=reward_math_boxed, args=config, train_dataset=dataset,
                                   peft_config=peft_config, callbacks=[Snapshots()])
    else:
        from trl import GRPOConfig, GRPOTrainer
        config = GRPOConfig(**common, per_device_train_batch_size=args.samples_per_step, beta=0.0,
                            model_init_kwargs={"dtype": torch.float32})
        trainer = GRPOTrainer(model=args.model, reward_funcs=reward_math_boxed, args=config, train_dataset=dataset,
                              peft_config=peft_config, callbacks=[Snapshots()])
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    record("end", steps=trainer.state.global_step, peak_rss_mb=peak)
    print(json.dumps({"event": "trained", "steps": trainer.state.global_step, "wall_s": time.time() - T0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
