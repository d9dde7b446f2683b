"""A user-defined multi-turn environment: the model guesses a number, the environment says higher or
lower, and the reward is 1 for finding it (less for each extra turn), 0 otherwise.

Run it from the repository root (the module is found next to rl.yaml):

    grpo --config examples/multi_turn/rl.yaml

`env: [{id: "guess_number:load_environment", args: {...}}]` calls load_environment(**args); it may
return any SingleTurnEnv / MultiTurnEnv. Environment replies are part of later prompts but never
train: only the model's turns carry loss.
"""

from __future__ import annotations

import random
import re
from typing import Any

from grpo.envs import EnvReply, Message, MultiTurnEnv

_NUMBER = re.compile(r"-?\d+")


def _guess(text: str) -> int | None:
    """The last integer in the model's reply."""
    numbers = _NUMBER.findall(text)
    return int(numbers[-1]) if numbers else None


class GuessNumberEnv(MultiTurnEnv):
    async def reset(self, example: dict[str, Any]) -> dict[str, Any]:
        return {"target": int(example["answer"]), "turns": 0, "found": False}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        state["turns"] += 1
        guess = _guess(str(messages[-1].get("content", "")))
        if guess is None:
            return EnvReply([{"role": "user", "content": "Reply with a single number."}], done=False)
        if guess == state["target"]:
            state["found"] = True
            return EnvReply([], done=True)
        hint = "higher" if guess < state["target"] else "lower"
        return EnvReply([{"role": "user", "content": f"{guess} is wrong; go {hint}."}], done=False)


def found_it(state: dict[str, Any]) -> float:
    """1 for finding the number on the first turn, halved for every extra turn; 0 when never found."""
    return 0.5 ** (state["turns"] - 1) if state.get("found") else 0.0


def load_environment(
    num_examples: int = 200, low: int = 1, high: int = 10, max_turns: int = 4, seed: int = 0
) -> GuessNumberEnv:
    if not 0 <= low < high:
        raise ValueError(f"env guess_number: needs 0 <= low < high, got low {low}, high {high}")
    rng = random.Random(seed)
    examples = [
        {
            "prompt": f"I picked a whole number from {low} to {high}. Guess it.",
            "answer": str(rng.randint(low, high)),
        }
        for _ in range(num_examples)
    ]
    return GuessNumberEnv(
        examples=examples,
        rewards=[found_it],
        max_turns=max_turns,
        system_prompt="Reply with one number only.",
        name="guess-number",
    )
