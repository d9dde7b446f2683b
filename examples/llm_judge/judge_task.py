"""Short factual questions scored by an LLM judge (configured in rl.yaml) and a group reward.

The judge decides correctness; `concise` is a group-level reward (`@group_reward`): it sees all
completions of one question at once and ranks their lengths, so the
shortest reply of a group gets 1.0 and the longest 0.0.
"""

from __future__ import annotations

from grpo.envs import SingleTurnEnv, group_reward

QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("How many legs does a spider have?", "8"),
    ("What gas do plants take in for photosynthesis?", "carbon dioxide"),
    ("Who wrote 'Pride and Prejudice'?", "Jane Austen"),
    ("What is 12 times 12?", "144"),
    ("What is the largest planet in the solar system?", "Jupiter"),
]


@group_reward
def concise(completions: list[str]) -> list[float]:
    """Rank of each reply by length within its group: shortest 1.0, longest 0.0."""
    order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
    scores = [0.0] * len(completions)
    for position, i in enumerate(order):
        scores[i] = 1.0 - position / max(1, len(completions) - 1)
    return scores


def load_environment() -> SingleTurnEnv:
    examples = [{"prompt": q, "answer": a} for q, a in QUESTIONS]
    return SingleTurnEnv(
        examples,
        [concise],
        weights=[0.1],
        system_prompt="Answer in one short sentence.",
        name="llm-judge",
    )
