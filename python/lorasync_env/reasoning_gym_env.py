"""reasoning-gym tasks as a lorasync environment.

    python -m lorasync_env.reasoning_gym_env --task chain_sum --task basic_arithmetic \
        --size 200 --seed 1 --max-turns 2

The `--task` names (any of reasoning-gym's registered datasets; several make an equal-weight mix)
become one reasoning-gym composite dataset (`create_dataset("composite", ...)`) of `--size`
procedural items generated from `--seed`; nothing is downloaded. The trainer's row "index"
(mod size) picks the item, so a row always gets the same question; the request's "seed" is not
needed (generation is deterministic by index).

Observation: reasoning-gym's own "default" system prompt (answer inside <answer></answer>) and the
item's question as a user message. Reward: reasoning-gym's `extract_answer` (the last
<answer>...</answer> of the turn's text, None without one) scored by the dataset's own
`score_answer(answer, entry)`. With `--max-turns N` > 1, an attempt that scores below 1 is answered
"That is not correct, try again." until N attempts; the episode ends at the first attempt that
scores 1 or at the Nth, and its reward is the score of that final attempt (earlier attempts give
0, so the episode's sum is the final score).
"""

from __future__ import annotations

import argparse
import sys

from .protocol import Environment, main, system, user

RETRY_MESSAGE = "That is not correct, try again."


def build_dataset(tasks: list[str], size: int, seed: int):
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name=t, weight=1.0, config={}) for t in dict.fromkeys(tasks)]
    return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)


class ReasoningGymEnv(Environment):
    def __init__(self, tasks: list[str], size: int = 1000, seed: int = 0, max_turns: int = 1,
                 system_prompt: str | None = "default"):
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        if max_turns < 1:
            raise ValueError("--max-turns must be at least 1")
        self.dataset = build_dataset(tasks, size, seed)
        self.size = size
        self.max_turns = max_turns
        self.system_prompt = SYSTEM_PROMPTS[system_prompt] if system_prompt else None
        self.extract_answer = extract_answer
        self.entry = None
        self.attempts = 0

    def reset(self, row, seed):
        index = row.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError('row "index" must be an integer')
        index %= self.size
        self.entry = self.dataset[index]
        self.attempts = 0
        messages = [user(self.entry["question"])]
        if self.system_prompt:
            messages.insert(0, system(self.system_prompt))
        return messages, {"task": self.entry["metadata"]["source_dataset"], "item": index}

    def step(self, action):
        self.attempts += 1
        answer = self.extract_answer(action.get("text", ""))
        score = float(self.dataset.score_answer(answer, self.entry))
        info = {"task": self.entry["metadata"]["source_dataset"], "attempt": self.attempts,
                "answer": answer, "score": score}
        if score >= 1.0 or self.attempts >= self.max_turns:
            return None, score, True, info
        return [user(RETRY_MESSAGE)], 0.0, False, info


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m lorasync_env.reasoning_gym_env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", action="append", required=True,
                   help="reasoning-gym dataset name; repeat for a mix (equal weights)")
    p.add_argument("--size", type=int, default=1000, help="items in the dataset (row index mod size)")
    p.add_argument("--seed", type=int, default=0, help="the dataset's generation seed")
    p.add_argument("--max-turns", type=int, default=1, help="attempts per episode")
    p.add_argument("--system-prompt", default="default",
                   help="a key of reasoning_gym.utils.SYSTEM_PROMPTS, or 'none'")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    main(lambda: ReasoningGymEnv(args.task, args.size, args.seed, args.max_turns,
                                 None if args.system_prompt == "none" else args.system_prompt))
