"""three-words: describe a topic in exactly three words; a graded reward for the length.

A format task the 135M model can learn within a few steps (it answers in sentences at first), so a
learning-speed comparison sees the reward move. Loaded by import path (env id
"three_words:load_environment" with benchmarks/tasks/ on the import path; e2e_bench.py and
trl_bench.py put it there).
"""

from __future__ import annotations

import random
import re

from grpo.envs.single_turn import SingleTurnEnv

SYSTEM_PROMPT = "Reply with exactly three words."

TOPICS = (
    *("the ocean", "winter", "a forest", "coffee", "the moon", "a city at night", "rain", "music"),
    *("a library", "autumn", "the desert", "a storm", "friendship", "a garden", "the sun", "snow"),
    *("a river", "mountains", "a market", "the sea breeze", "a train ride", "bread", "a candle"),
    *("the sky", "a cat", "a dog", "summer", "spring", "a bicycle", "a kitchen", "the wind"),
    *("a museum", "a beach", "fire", "a clock", "tea", "a bridge", "a harbour", "an island"),
)

_WORD = re.compile(r"[A-Za-z0-9']+")


def three_words_reward(completion: str) -> float:
    """1 for three words; n/3 below three, 3/n above (a long sentence earns a little)."""
    num_words = len(_WORD.findall(completion))
    if num_words == 0:
        return 0.0
    return num_words / 3 if num_words < 3 else 3 / num_words


def load_environment(num_examples: int = 1000, seed: int = 0) -> SingleTurnEnv:
    rng = random.Random(seed)
    examples = [{"prompt": f"Describe {rng.choice(TOPICS)}."} for _ in range(num_examples)]
    return SingleTurnEnv(
        examples=examples, rewards=[three_words_reward], system_prompt=SYSTEM_PROMPT, name="three-words"
    )
