"""verifiers environments (`- id: <taskset id>`, verifiers >= 0.4's v1 Taskset API) as grpo
environments: small tasksets written here into an importable package on a tmp path, resolved by id as
verifiers resolves them."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from grpo.config.orchestrator import EnvConfig
from grpo.envs.base import Environment, Score
from grpo.envs.loading import check_environment, load_environment
from grpo.envs.verifiers_env import check_version

ARITH = """
import asyncio

import verifiers.v1 as vf

CALLS = []


class ArithConfig(vf.TasksetConfig):
    num_rows: int = 3


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact(self, task, trace) -> float:
        if trace.last_reply == "boom":
            raise RuntimeError("reward broke")
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        await asyncio.sleep(0)
        CALLS.append(trace.last_reply)
        return 1.0 / (1 + len(trace.last_reply))

    @vf.metric
    async def num_chars(self, trace) -> float:
        return float(len(trace.last_reply))


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        for i in range(self.config.num_rows):
            yield ArithTask(
                ArithData(prompt=f"{i}+{i}=?", system_prompt="Answer with a number.", answer=str(2 * i)),
                self.config.task,
            )


__all__ = ["ArithTaskset"]
"""

ECHO = """
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=2.0)
    async def repeated(self, task, trace) -> float:
        replies = [m.content for m in trace.assistant_messages]
        return float(len(replies) == 2 and replies[0] == replies[1] == task.answer)

    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return trace.last_reply == "give up"


class EchoEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class EchoEnv(vf.Env[EchoEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            if segment.last_reply == "crash":
                raise RuntimeError("env broke")
            if not segment.terminated:
                segment = await interaction.turn("Say it again.")
        interaction.trace.record_reward("finished", float(not segment.terminated), 0.25)


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for word in ("apple", "river"):
            yield EchoTask(EchoData(prompt=[vf.UserMessage(content=f"Say {word}.")], answer=word))


__all__ = ["EchoEnv", "EchoTaskset"]
"""

COUNTER = """
import itertools

import verifiers.v1 as vf


class CounterTask(vf.Task):
    @vf.reward
    async def one(self) -> float:
        return 1.0


class CounterTaskset(vf.Taskset[CounterTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self):
        for i in itertools.count():
            yield CounterTask(vf.TaskData(prompt=str(i)))


__all__ = ["CounterTaskset"]
"""

TWO_SEATS = """
import verifiers.v1 as vf


class DuelConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig()
    second: vf.AgentConfig = vf.AgentConfig()


class DuelEnv(vf.Env[DuelConfig]):
    async def run(self, task, agents):
        await agents.first.run(task)


class DuelTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="hi"))


__all__ = ["DuelEnv", "DuelTaskset"]
"""

NOT_A_TASKSET = """
def load():
    return 1


__all__ = ["load"]
"""


@pytest.fixture(scope="module", autouse=True)
def tasksets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    root = tmp_path_factory.mktemp("tasksets")
    sources = {
        "vf_arith": ARITH,
        "vf_echo": ECHO,
        "vf_counter": COUNTER,
        "vf_not_a_taskset": NOT_A_TASKSET,
        "vf_duel": TWO_SEATS,
    }
    for name, source in sources.items():
        (root / f"{name}.py").write_text(source)
    sys.path.insert(0, str(root))
    yield
    sys.path.remove(str(root))


def _env(env_id: str, **args: Any) -> Any:
    return load_environment(EnvConfig(id=env_id, args=args))


def _run(env: Any, example: dict[str, Any], replies: list[str]) -> tuple[list[Any], Score]:
    """Play one rollout as the orchestrator does: the model's replies, one step after each but the
    last allowed turn; returns the env's replies and the score."""

    async def play() -> tuple[list[Any], Score]:
        state = await env.reset(example)
        history = env.prompt_messages(example)
        completion: list[dict[str, Any]] = []
        env_replies = []
        for turn, text in enumerate(replies):
            message = {"role": "assistant", "content": text}
            history.append(message)
            completion.append(message)
            if turn == env.max_turns - 1:
                break
            reply = await env.step(history, state)
            env_replies.append(reply)
            if reply.done:
                break
            history += reply.messages
            completion += reply.messages
        return env_replies, await env.score(example, completion, state)

    return asyncio.run(play())


def test_a_taskset_id_loads_its_tasks_as_examples_with_their_system_prompt() -> None:
    env = _env("vf-arith", num_rows=2)
    assert isinstance(env, Environment) and env.name == "vf-arith" and env.max_turns == 1
    assert [e["prompt"] for e in env.examples] == ["0+0=?", "1+1=?"]
    assert env.examples[1]["info"] == {"idx": 1, "answer": "2"}
    assert env.prompt_messages(env.examples[1]) == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "1+1=?"},
    ]


def test_num_examples_and_seed_pick_and_shuffle_the_tasks() -> None:
    assert len(_env("vf-arith", num_rows=5, num_examples=2).examples) == 2
    shuffled = [e["prompt"] for e in _env("vf-arith", num_rows=5, seed=3).examples]
    assert sorted(shuffled) == [f"{i}+{i}=?" for i in range(5)] and shuffled != sorted(shuffled)
    assert shuffled == [e["prompt"] for e in _env("vf-arith", num_rows=5, seed=3).examples]
    assert len(_env("vf-counter", num_examples=4).examples) == 4


def test_rewards_are_weighted_and_every_function_is_its_own_metric() -> None:
    import vf_arith

    env = _env("vf-arith")
    _, score = _run(env, env.examples[2], ["4"])
    assert score.failure is None
    assert score.metrics == {"exact": 1.0, "short": 0.5, "num_chars": 1.0}
    assert score.reward == pytest.approx(1.0 * 1.0 + 0.5 * 0.5)  # metrics do not add to the reward
    _, score = _run(env, env.examples[2], ["twelve"])
    assert score.metrics["exact"] == 0.0 and score.reward == pytest.approx(0.5 / 7)
    assert vf_arith.CALLS[-2:] == ["4", "twelve"]


def test_a_raising_reward_fails_only_its_rollout() -> None:
    env = _env("vf-arith")
    _, broken = _run(env, env.examples[0], ["boom"])
    assert broken.failed and "reward broke" in (broken.failure or "")
    _, fine = _run(env, env.examples[0], ["0"])
    assert fine.failure is None and fine.metrics["exact"] == 1.0


def test_an_env_run_replies_between_model_turns_and_its_rewards_count() -> None:
    env = _env("vf-echo")
    assert env.max_turns == 8  # the seat sets none: grpo's default
    assert env.prompt_messages(env.examples[0]) == [{"role": "user", "content": "Say apple."}]
    replies, score = _run(env, env.examples[0], ["apple", "apple"])
    assert [(r.messages, r.done) for r in replies] == [
        ([{"role": "user", "content": "Say it again."}], False),
        ([], True),
    ]
    assert score.metrics == {"repeated": 1.0, "finished": 1.0}
    assert score.reward == pytest.approx(2.0 + 0.25)


def test_its_rewards_are_the_whole_rollouts_so_no_step_returns_a_turn_reward() -> None:
    # verifiers' Trace has named rollout rewards only (one recorded by the Env's run between turns
    # included): all of them are the score, which the rollout loop puts on the last turn.
    env = _env("vf-echo")
    replies, score = _run(env, env.examples[0], ["apple", "apple"])
    assert [r.reward for r in replies] == [None, None]
    assert score.reward == pytest.approx(2.0 + 0.25)


def test_the_turn_limit_ends_the_run_with_a_terminated_turn() -> None:
    env = _env("vf-echo", max_turns=1)
    replies, score = _run(env, env.examples[1], ["river"])
    assert replies == [] and score.metrics == {"repeated": 0.0, "finished": 0.0}


def test_a_trace_stop_ends_the_exchange() -> None:
    env = _env("vf-echo")
    replies, score = _run(env, env.examples[1], ["give up", "never asked"])
    assert [r.done for r in replies] == [True] and score.metrics["finished"] == 0.0


def test_an_env_run_that_raises_fails_its_step() -> None:
    env = _env("vf-echo")
    with pytest.raises(RuntimeError, match="env broke"):
        _run(env, env.examples[0], ["crash", "apple"])


def test_dry_run_check_accepts_a_taskset_and_refuses_mistakes_in_one_line() -> None:
    check_environment(EnvConfig(id="vf-arith", args={"num_rows": 2, "num_examples": 1}))
    bad = [
        (
            "vf-arith",
            {"num_rowz": 2},
            "arg 'num_rowz': Extra inputs are not permitted; did you mean 'num_rows'?",
        ),
        ("vf-arith", {"seed": "x"}, "seed must be a whole number, got 'x'"),
        ("vf-arith", {"num_rows": "many"}, "arg 'num_rows'"),
        ("vf-counter", {}, "its taskset is infinite; set env[].args.num_examples"),
        ("vf-arith", {"num_examples": 0}, "num_examples must be a whole number >= 1"),
        ("vf-not-a-taskset", {}, "exports no Taskset subclass"),
        ("vf-duel", {}, "its Env DuelEnv has 2 agent seats (first, second); grpo trains one seat"),
        ("vf-no-such-taskset", {}, "pip install 'grpo-rl[verifiers]'"),
    ]
    for env_id, args, expected in bad:
        with pytest.raises(ValueError) as info:
            check_environment(EnvConfig(id=env_id, args=args))
        message = str(info.value)
        assert expected in message and "\n" not in message, message


def test_a_verifiers_older_than_0_4_is_refused_with_the_fix() -> None:
    check_version("0.4.0")
    check_version("0.4.1.dev3")
    with pytest.raises(
        ValueError, match=r"verifiers 0\.1\.9 is installed; .*pip install 'grpo-rl\[verifiers\]'"
    ):
        check_version("0.1.9")
