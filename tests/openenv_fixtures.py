"""A tiny OpenEnv environment served by OpenEnv's own server (openenv-core's create_fastapi_app), for the
OpenEnv tests (tests/envs) and the co-located run (tests/colocate).

Guess the number: reset(seed) picks 1..10 from the seed; each step takes the last number in the message,
rewards 1.0 and ends the episode when it is right, else says "higher"/"lower" with reward WRONG; the
episode also ends after MAX_GUESSES.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

# openenv-core is an extra: make setup installs it; a machine without it (the GPU validation) skips
# the modules that use these fixtures rather than failing to collect them.
pytest.importorskip("openenv")

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from grpo.envs.server import BackgroundServer

MAX_GUESSES = 3
WRONG = -0.25


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""
    guesses_left: int = 0


def target(seed: int) -> int:
    return seed % 10 + 1


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self._target = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._target = target(seed or 0)
        return GuessObservation(
            prompt=f"Game {seed}: guess my number from 1 to 10.", guesses_left=MAX_GUESSES
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        numbers = re.findall(r"\d+", action.message)
        guess = int(numbers[-1]) if numbers else 0
        left = MAX_GUESSES - self._state.step_count
        if guess == self._target:
            return GuessObservation(prompt="right", guesses_left=left, reward=1.0, done=True)
        hint = "higher" if guess < self._target else "lower"
        return GuessObservation(prompt=hint, guesses_left=left, reward=WRONG, done=left == 0)

    @property
    def state(self) -> State:
        return self._state


def guess_server(max_concurrent_envs: int = 8) -> BackgroundServer:
    """The guess environment on a free loopback port (start() returns "127.0.0.1:PORT")."""
    app = create_fastapi_app(
        GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=max_concurrent_envs
    )
    return BackgroundServer(app)
