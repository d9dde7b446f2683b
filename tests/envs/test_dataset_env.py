"""`- dataset:` env blocks: rows of a jsonl/parquet file scored by TRL-style reward functions, called
once per group with TRL's arguments; every mistake in the block is one line at load (and dry-run)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from grpo.config.loading import validate
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.envs import Environment, load_environment
from grpo.envs.base import GroupScoring, Score
from grpo.envs.dataset_env import DatasetEnv
from grpo.envs.loading import check_environment

ROWS = [
    {"prompt": "2+2?", "answer": "4", "kind": "math"},
    {"prompt": "Say hi.", "answer": "hi", "kind": "chat"},
]
CALLS: list[dict[str, Any]] = []


def exact(
    prompts: list[Any], completions: list[Any], completion_ids: list[Any], answer: list[str], **kw: Any
) -> list[float]:
    CALLS.append({"fn": "exact", "prompts": prompts, "completions": completions, "ids": completion_ids, **kw})
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


async def brevity(completions: list[Any], kind: list[str], **kw: Any) -> list[float | None]:
    """Applies to math rows only (None elsewhere): 1 for a reply of at most 2 characters."""
    await asyncio.sleep(0)
    return [None if k != "math" else float(len(c) <= 2) for c, k in zip(completions, kind, strict=True)]


def never(completions: list[Any], **kw: Any) -> list[None]:
    return [None] * len(completions)


def raises(completions: list[Any], **kw: Any) -> list[float]:
    raise RuntimeError("judge down")


def slow(completions: list[Any], **kw: Any) -> list[float]:
    import time

    time.sleep(1.0)
    return [1.0] * len(completions)


def too_short(completions: list[Any], **kw: Any) -> list[float]:
    return [1.0]


def nan_for_long(completions: list[Any], **kw: Any) -> list[float]:
    return [float("nan") if len(c) > 2 else 0.5 for c in completions]


def text_only(completions: list[str]) -> list[float]:
    return [1.0 for _ in completions]


def chat_content(completions: list[Any], **kw: Any) -> list[float]:
    return [float(c[0]["content"] == "hi") for c in completions]


NOT_A_FUNCTION = 3


def as_array(completions: list[Any], **kw: Any) -> Any:
    import numpy as np

    return np.array([len(c) for c in completions], dtype=np.float32)


class AsyncJudge:
    """A callable object with an async __call__ (iscoroutinefunction does not see it)."""

    async def __call__(self, completions: list[Any], **kw: Any) -> list[float]:
        await asyncio.sleep(0)
        return [0.5 for _ in completions]


judge = AsyncJudge()


def _jsonl(tmp_path: Path, rows: list[dict[str, Any]] = ROWS, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(path: Path | str, *funcs: str, **kw: Any) -> DatasetEnvConfig:
    return DatasetEnvConfig(dataset=str(path), reward_funcs=[f"{__name__}:{f}" for f in funcs], **kw)


def _reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _score(env: Any, index: int, *texts: str) -> list[Score]:
    ids = [[ord(ch) for ch in t] for t in texts]
    scores: list[Score] = asyncio.run(env.score_group(env.examples[index], [_reply(t) for t in texts], ids))
    return scores


def test_two_reward_functions_score_a_group_with_their_weights(tmp_path: Path) -> None:
    CALLS.clear()
    env = load_environment(_cfg(_jsonl(tmp_path), "exact", "brevity", reward_weights=[1.0, 0.5]))
    assert isinstance(env, Environment) and isinstance(env, GroupScoring) and env.name == "data"
    # math row: both apply; reward = 1.0 * exact + 0.5 * brevity
    math = _score(env, 0, "4", "5", "four")
    assert [s.reward for s in math] == [1.5, 0.5, 0.0]
    assert [s.metrics for s in math] == [
        {"exact": 1.0, "brevity": 1.0},
        {"exact": 0.0, "brevity": 1.0},
        {"exact": 0.0, "brevity": 0.0},
    ]
    # chat row: brevity returns None (not applicable), so only exact counts
    chat = _score(env, 1, "hi", "hello there")
    assert [s.reward for s in chat] == [1.0, 0.0] and all("brevity" not in s.metrics for s in chat)
    assert not any(s.failed for s in math + chat)
    # called once per group, with TRL's arguments: one entry per completion
    first = CALLS[0]
    assert first["prompts"] == ["2+2?"] * 3 and first["completions"] == ["4", "5", "four"]
    assert (
        first["ids"] == [[ord("4")], [ord("5")], [ord(c) for c in "four"]] and first["kind"] == ["math"] * 3
    )
    assert len(CALLS) == 2


def test_chat_prompts_get_message_list_completions(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "Say hi."}], "answer": "hi"}]
    env = load_environment(
        _cfg(_jsonl(tmp_path, rows), "chat_content", prompt_column="messages", system_prompt="Be brief.")
    )
    assert env.examples[0]["prompt"] == rows[0]["messages"] and "messages" not in env.examples[0]
    assert env.prompt_messages(env.examples[0]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hi."},
    ]
    assert [s.reward for s in _score(env, 0, "hi", "no")] == [1.0, 0.0]


def test_a_completion_no_function_applies_to_is_unscored(tmp_path: Path) -> None:
    env = load_environment(_cfg(_jsonl(tmp_path), "never", "brevity"))
    math, chat = _score(env, 0, "4")[0], _score(env, 1, "hi")[0]
    assert not math.failed and math.reward == 1.0
    assert chat.failed and chat.failure == "every reward function returned None (none applies)"


@pytest.mark.parametrize(
    ("fn", "failure"),
    [
        ("raises", "reward raises raised RuntimeError"),
        ("too_short", "reward too_short returned a bad list"),
        ("slow", "reward slow timed out after 0.2s over a group"),
    ],
)
def test_a_function_that_fails_over_the_group_fails_every_rollout_of_it(
    tmp_path: Path, fn: str, failure: str
) -> None:
    env = load_environment(_cfg(_jsonl(tmp_path), "exact", fn, reward_timeout=0.2))
    scores = _score(env, 0, "4", "5")
    assert all(s.failed and s.failure == failure and s.reward == 0.0 for s in scores)


def test_a_non_finite_value_fails_that_completion_only(tmp_path: Path) -> None:
    env = load_environment(_cfg(_jsonl(tmp_path), "nan_for_long"))
    short, long = _score(env, 0, "4", "four")
    assert not short.failed and short.reward == 0.5
    assert long.failed and long.failure == "reward nan_for_long returned nan, not a finite number"


async def waits_for_other(completions: list[Any], **kw: Any) -> list[float]:
    EVENTS["a"].set()
    await asyncio.wait_for(EVENTS["b"].wait(), 5)
    return [1.0] * len(completions)


async def sets_other(completions: list[Any], **kw: Any) -> list[float]:
    await asyncio.wait_for(EVENTS["a"].wait(), 5)
    EVENTS["b"].set()
    return [2.0] * len(completions)


EVENTS: dict[str, asyncio.Event] = {}


def test_async_functions_are_awaited_concurrently(tmp_path: Path) -> None:
    # each waits for the other: awaited one after the other, the first would time out
    env = load_environment(_cfg(_jsonl(tmp_path), "waits_for_other", "sets_other", reward_timeout=2))

    async def run() -> list[Score]:
        EVENTS.update(a=asyncio.Event(), b=asyncio.Event())
        scores: list[Score] = await env.score_group(env.examples[0], [_reply("4")], [[1]])  # type: ignore[attr-defined]
        return scores

    (score,) = asyncio.run(run())
    assert not score.failed and score.reward == 3.0


def test_parquet_files_and_num_examples(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS * 3), path)
    env = load_environment(_cfg(path, "exact", num_examples=4, name="pq"))
    assert len(env.examples) == 4 and env.name == "pq" and env.examples[1]["answer"] == "hi"


def test_the_dry_run_check_builds_the_env_and_the_run_reuses_it(tmp_path: Path) -> None:
    cfg = _cfg(_jsonl(tmp_path), "exact")
    check_environment(cfg)
    (tmp_path / "data.jsonl").unlink()  # the run's load takes what the check built
    env = load_environment(cfg)
    assert isinstance(env, DatasetEnv) and len(env.examples) == 2


def _one_line_error(cfg: DatasetEnvConfig) -> str:
    """The error check_environment (dry-run) gives; load_environment gives the same one."""
    messages = []
    for call in (check_environment, load_environment):
        with pytest.raises(ValueError) as info:
            call(cfg)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "\n" not in messages[0], messages
    return messages[0]


def test_bad_dataset_blocks_are_one_line_at_load(tmp_path: Path) -> None:
    data = _jsonl(tmp_path)
    assert _one_line_error(_cfg(data, "exact", prompt_column="question")) == (
        f"env data: dataset {data} has no column 'question' (prompt_column); its columns: prompt, answer, kind"
    )
    assert "has no attribute 'exactt'; did you mean" in _one_line_error(_cfg(data, "exactt"))
    assert f"did you mean {__name__}:exact?" in _one_line_error(_cfg(data, "exactt"))
    missing = DatasetEnvConfig(dataset=str(data), reward_funcs=["no_such_rewards_module:fn"])
    assert "reward_funcs[0] 'no_such_rewards_module:fn': no module named 'no_such_rewards_module'" in (
        _one_line_error(missing)
    )
    signature = _one_line_error(_cfg(data, "exact", "text_only"))
    assert f"reward_funcs[1] '{__name__}:text_only': cannot be called as fn(prompts, completions" in signature
    assert "add **kwargs" in signature
    assert "is a int, not a function" in _one_line_error(_cfg(data, "NOT_A_FUNCTION"))
    assert "does not exist" in _one_line_error(_cfg(tmp_path / "nope.jsonl", "exact"))
    assert "has a 'prompt' column besides prompt_column 'kind'" in _one_line_error(
        _cfg(data, "exact", prompt_column="kind")
    )


def test_bad_rows_are_one_line_at_load(tmp_path: Path) -> None:
    numbers = _jsonl(tmp_path, [{"prompt": "a"}, {"prompt": 3}], "numbers.jsonl")
    assert "row 1: column 'prompt' holds '3', neither a string nor a list of chat messages" in (
        _one_line_error(_cfg(numbers, "exact"))
    )
    clash = _jsonl(tmp_path, [{"prompt": "a", "completions": "x"}], "clash.jsonl")
    assert "column 'completions' has the name of an argument" in _one_line_error(_cfg(clash, "exact"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{"prompt": \n')
    assert f"cannot read {broken}" in _one_line_error(_cfg(broken, "exact"))


def test_an_unreachable_hub_dataset_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    message = _one_line_error(_cfg("someone/no-such-dataset", "exact"))
    assert message.startswith("env no-such-dataset: cannot load hub dataset 'someone/no-such-dataset'")
    assert "point dataset: at a local .jsonl or .parquet file" in message


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({"reward_funcs": ["m:f"], "reward_weights": [1, 2]}, "2 reward_weights for 1 reward_funcs"),
        ({"reward_funcs": ["rewards.py"]}, "reward function 'rewards.py' names no function"),
        ({"reward_funcs": []}, "'env[0].reward_funcs'"),
        ({"reward_func": ["m:f"]}, "unknown key 'env[0].reward_func'; did you mean 'env[0].reward_funcs'?"),
        ({"reward_funcs": ["m:f"], "args": {}}, "unknown key 'env[0].args'"),
    ],
)
def test_bad_block_keys_are_config_errors(block: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError) as info:
        validate(OrchestratorConfig, {"env": [{"dataset": "d.jsonl", **block}]}, "orch.yaml")
    assert expected in str(info.value), str(info.value)


def test_dataset_and_id_blocks_mix_in_one_config() -> None:
    cfg = validate(
        OrchestratorConfig,
        {"env": [{"id": "math"}, {"dataset": "d.jsonl", "reward_funcs": ["m:f"]}]},
        "orch.yaml",
    )
    assert isinstance(cfg.env[1], DatasetEnvConfig) and cfg.env[1].display_name == "d"
    assert DatasetEnvConfig(dataset="openai/gsm8k", reward_funcs=["m:f"]).display_name == "gsm8k"


def test_arrays_and_async_callable_objects_are_taken_as_trl_takes_them(tmp_path: Path) -> None:
    env = load_environment(_cfg(_jsonl(tmp_path), "as_array", "judge"))
    assert [s.reward for s in _score(env, 0, "4", "four")] == [1.5, 4.5]
