"""A small OpenEnv environment server, written as OpenEnv documents it (Action and Observation
models, an Environment subclass, create_app): guess a five-letter word in up to four tries.

reset(seed) picks the word from the seed; each step reads the last word of the guess, answers
with the letters in the right places ("c _ _ _ e"), and ends the episode with reward 1.0 when the
word is right (0.0 for a wrong guess). Run it (needs `pip install 'grpo-rl[openenv]'`):

    python examples/openenv/word_server.py --port 8001
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ("crane", "slate", "pride", "mound", "light", "brick", "flame", "ghost", "plant", "storm")
MAX_GUESSES = 4


class WordAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str = ""


class WordEnvironment(Environment[WordAction, WordObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every session gets its own instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self._word = WORDS[0]

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> WordObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._word = WORDS[(seed or 0) % len(WORDS)]
        prompt = (
            f"Guess my five-letter word; it starts with '{self._word[0]}'. You have {MAX_GUESSES} tries. "
            "Answer with the word only."
        )
        return WordObservation(prompt=prompt)

    def step(self, action: WordAction, timeout_s: float | None = None, **kwargs: Any) -> WordObservation:  # type: ignore[override]
        self._state.step_count += 1
        words = re.findall(r"[a-z]+", action.message.lower())
        guess = words[-1] if words else ""
        if guess == self._word:
            return WordObservation(prompt="Correct!", reward=1.0, done=True)
        hint = " ".join(c if i < len(guess) and guess[i] == c else "_" for i, c in enumerate(self._word))
        left = MAX_GUESSES - self._state.step_count
        return WordObservation(
            prompt=f"Not it. Right letters in place: {hint}. Tries left: {left}.", reward=0.0, done=left == 0
        )

    @property
    def state(self) -> State:
        return self._state


def build_app(max_concurrent_envs: int = 16) -> Any:
    return create_app(WordEnvironment, WordAction, WordObservation, max_concurrent_envs=max_concurrent_envs)


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--max-concurrent-envs", type=int, default=16)
    cli = parser.parse_args()
    uvicorn.run(build_app(cli.max_concurrent_envs), host="127.0.0.1", port=cli.port)
