"""reverse-text: reverse a short random text; reward = similarity of the reply to the reversed text.

Data is generated offline from a fixed word list and a seed, so the environment needs no download.
"""

from __future__ import annotations

import difflib
import random

from grpo.envs.base import check_num_examples
from grpo.envs.single_turn import SingleTurnEnv
from grpo.utils.errors import UserError

_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "garden",
    "yellow",
    "quiet",
    "orange",
    "silver",
    "window",
    "forest",
    "candle",
    "ocean",
    "little",
    "bright",
    "mountain",
    "paper",
    "winter",
    "summer",
    "rabbit",
    "pencil",
    "coffee",
    "planet",
    "rocket",
    "music",
    "green",
    "tiger",
    "bridge",
    "lemon",
    "castle",
    "dream",
    "shadow",
    "violet",
    "thunder",
    "honey",
    "marble",
    "feather",
    "valley",
    "copper",
]

SYSTEM_PROMPT = "Reverse the text character by character. Reply with the reversed text only."


def make_texts(num_examples: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(min_words, max_words))) for _ in range(num_examples)]


def reversal_similarity(completion: str, answer: str) -> float:
    """1.0 for the exact reversal, lower the more characters differ (difflib ratio)."""
    return difflib.SequenceMatcher(None, completion.strip(), answer).ratio()


def load_environment(
    num_examples: int = 1000, min_words: int = 1, max_words: int = 4, seed: int = 0
) -> SingleTurnEnv:
    check_num_examples("reverse-text", num_examples)
    if min_words < 1 or max_words < min_words:
        raise UserError(
            f"env reverse-text: needs 1 <= min_words <= max_words, got min_words {min_words}, max_words "
            f"{max_words}; fix env[].args"
        )
    texts = make_texts(num_examples, min_words, max_words, seed)
    examples = [{"prompt": t, "answer": t[::-1], "task": "reverse-text"} for t in texts]
    return SingleTurnEnv(
        examples=examples, rewards=[reversal_similarity], system_prompt=SYSTEM_PROMPT, name="reverse-text"
    )
