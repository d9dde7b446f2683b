"""A verifiers environment (verifiers >= 0.4, `import verifiers.v1 as vf`) that grpo trains as it is:
the model guesses a number, the environment says higher or lower, and the reward is 1 for finding it
(less for each extra turn), plus a small bonus for answering with a bare number.

verifiers finds it by id: `- id: vf-guess-number` imports the module `vf_guess_number` (the id with
`-` read as `_`), which exports its Taskset (and its Env) through `__all__`. Installed as a package
(`pip install -e .` of a verifiers environment), no PYTHONPATH is needed. From the repository root:

    PYTHONPATH=examples/verifiers grpo --config examples/verifiers/rl.yaml
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

_NUMBER = re.compile(r"-?\d+")


def _guess(text: str) -> int | None:
    """The last integer in a reply."""
    numbers = _NUMBER.findall(text)
    return int(numbers[-1]) if numbers else None


class GuessConfig(vf.TasksetConfig):
    """env[].args (besides grpo's own num_examples, seed and max_turns)."""

    low: int = 1
    high: int = 10
    num_rows: int = 100


class GuessData(vf.TaskData):
    target: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def found(self, task: GuessData, trace: vf.Trace) -> float:
        """1 for a first-turn hit, halved for each extra turn; 0 if never found."""
        for turn, message in enumerate(trace.assistant_messages):
            if _guess(message.content or "") == task.target:
                return 0.5**turn
        return 0.0

    @vf.reward(weight=0.1)
    async def bare_number(self, trace: vf.Trace) -> float:
        """Replies that are just a number."""
        replies = [(m.content or "").strip() for m in trace.assistant_messages]
        return sum(bool(re.fullmatch(r"-?\d+", r)) for r in replies) / max(len(replies), 1)

    @vf.stop
    async def found_it(self, trace: vf.Trace) -> bool:
        return _guess(trace.last_reply) == trace.task.data.target


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=4)


class GuessEnv(vf.Env[GuessEnvConfig]):
    """Answers each guess with higher / lower until the task's stop (found it) or the turn limit."""

    async def run(self, task: GuessTask, agents: vf.Agents) -> None:
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                guess = _guess(segment.last_reply)
                if guess is None:
                    hint = "Answer with a number."
                else:
                    hint = "Higher." if guess < task.data.target else "Lower."
                segment = await interaction.turn(hint)


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> Iterator[GuessTask]:
        rng = random.Random(0)
        c = self.config
        for _ in range(c.num_rows):
            yield GuessTask(
                GuessData(
                    prompt=f"I am thinking of a number between {c.low} and {c.high}. Guess it.",
                    system_prompt="Reply with one number.",
                    target=rng.randint(c.low, c.high),
                ),
                self.config.task,
            )


__all__ = ["GuessEnv", "GuessTaskset"]
