"""Environments served to RemoteEnv in tests; the loaders are import paths for `grpo-env` subprocesses.

`python -m grpo.cli.env remote_env_fixtures:load_guess_env` works with this folder on PYTHONPATH.
"""

from __future__ import annotations

from typing import Any

from grpo.envs import EnvReply, Example, Message, MultiTurnEnv, SingleTurnEnv

SECRET = 7


def load_echo_env() -> SingleTurnEnv:
    """Single-turn: two weighted rewards, a system prompt, string and chat-list prompts."""

    def exact(completion: str, answer: str) -> float:
        return float(completion.strip() == answer)

    async def brevity(completion: str) -> float:
        return 1.0 / (1 + len(completion))

    examples: list[Example] = [{"prompt": f"say {i}", "answer": str(i)} for i in range(5)]
    examples.append({"prompt": [{"role": "user", "content": "say 9"}], "answer": "9", "info": {"k": [1, 2]}})
    return SingleTurnEnv(
        examples, [exact, brevity], weights=[1.0, 0.5], system_prompt="be brief", name="echo"
    )


class GuessEnv(MultiTurnEnv):
    """Guess SECRET: the environment says higher/lower. The state holds a set (no JSON form), which is
    why state must stay on the server."""

    async def reset(self, example: Example) -> dict[str, Any]:
        return {"guesses": set()}

    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        guess = int(messages[-1]["content"])
        state["guesses"].add(guess)
        if guess == SECRET:
            return EnvReply([], done=True, reward=0.5)  # a turn reward crosses the wire too
        hint = "higher" if guess < SECRET else "lower"
        return EnvReply([{"role": "user", "content": hint}], done=False)


def load_guess_env() -> GuessEnv:
    def found(completion: str) -> float:
        return float(completion.splitlines()[-1] == str(SECRET))

    def fewer_guesses(state: dict[str, Any]) -> float:
        return 1.0 / max(1, len(state["guesses"]))

    examples: list[Example] = [{"prompt": "guess a number from 1 to 10"}, {"prompt": "guess again"}]
    return GuessEnv(examples, [found, fewer_guesses], max_turns=4, name="guess")


def load_broken_env() -> SingleTurnEnv:
    def broken(completion: str) -> float:
        raise RuntimeError("reward crashed")

    return SingleTurnEnv([{"prompt": "hi"}], [broken], name="broken")
