"""Guess the number: a small deterministic multi-turn lorasync environment (docs/environments.md).

    PYTHONPATH=<repo>/python python3 examples/envs/guess_number.py --low 1 --high 100 --max-turns 7

The env picks a number in [low, high] from the episode's seed; the model answers with a number
(the last integer in its turn); the env replies "higher" or "lower" until the number is guessed
or max-turns turns are used. Reward: 1 on the step that guesses it, 0 otherwise.
"""

import argparse
import random
import re
import sys

from lorasync_env import Environment, main, system, user


class GuessNumber(Environment):
    def __init__(self, low=1, high=100, max_turns=7):
        self.low, self.high, self.max_turns = low, high, max_turns

    def reset(self, row, seed):
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.turns = 0
        return [system("Play a guessing game. Answer with a single integer."),
                user(f"I picked a number between {self.low} and {self.high}. Guess it.")], {}

    def step(self, action):
        self.turns += 1
        numbers = re.findall(r"-?\d+", action["text"])
        guess = int(numbers[-1]) if numbers else None
        info = {"guess": guess, "turn": self.turns}
        if guess == self.secret:
            return None, 1.0, True, info
        if self.turns >= self.max_turns:
            return None, 0.0, True, info
        hint = "Answer with an integer." if guess is None else ("higher" if guess < self.secret else "lower")
        return [user(hint)], 0.0, False, info


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--low", type=int, default=1)
    p.add_argument("--high", type=int, default=100)
    p.add_argument("--max-turns", type=int, default=7)
    a = p.parse_args(sys.argv[1:])
    main(lambda: GuessNumber(a.low, a.high, a.max_turns))
