"""What a user writes under env[]: every mistake is one ValueError naming the key and the fix, found
by `check_environment` (the dry-run check, which runs user loaders but does not generate reasoning-gym
examples); correct input loads and scores."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from grpo.config.orchestrator import EnvConfig, OrchestratorConfig
from grpo.envs import Environment, SingleTurnEnv, load_environment
from grpo.envs.loading import check_environment, check_environments
from grpo.envs.math_env import math_verify_reward
from grpo.envs.reasoning_gym_env import extract_answer


def _check(env_id: str, **args: Any) -> None:
    check_environment(EnvConfig(id=env_id, args=args))


def _score(env: Environment, completion: str, index: int = 0) -> float:
    example = env.examples[index]
    score = asyncio.run(env.score(example, [{"role": "assistant", "content": completion}], {}))
    assert not score.failed, score.failure
    return score.reward


# (env id, args, text the error must contain)
BAD = [
    ("math", {"num_exampels": 3}, "unknown arg 'num_exampels' (env[].args); did you mean 'num_examples'?"),
    ("reverse-text", {"min_word": 2}, "did you mean 'min_words'?"),
    ("short-answer", {"sed": 1}, "did you mean 'seed'?"),
    ("math", {"num_examples": "three"}, "arg 'num_examples' must be int (default 1000), got 'three'"),
    ("math", {"num_examples": 2.5}, "arg 'num_examples' must be int"),
    ("math", {"num_examples": 0}, "num_examples must be a whole number >= 1, got 0"),
    ("reverse-text", {"min_words": 5, "max_words": 2}, "min_words 5, max_words 2"),
    ("reasoning-gym:chan_sum", {}, "no dataset 'chan_sum'; did you mean 'chain_sum'"),
    ("reasoning-gym:", {}, "needs a dataset name: id: reasoning-gym:<dataset>"),
    ("gsm8k-synthetic", {}, "is now 'math' (generated arithmetic and linear equations, not GSM8K)"),
    (
        "reasoning-gym:chain_sum",
        {"min_term": 2},
        "unknown arg 'min_term' (env[].args); did you mean 'min_terms'?",
    ),
    ("reasoning-gym:chain_sum", {"min_terms": "two"}, "arg 'min_terms' must be int (default 2), got 'two'"),
    ("reasoning-gym:chain_sum", {"allow_negation": "maybe"}, "arg 'allow_negation' must be bool"),
    ("reasoning-gym:chain_sum", {"min_terms": 5, "max_terms": 2}, "max_terms must be >= min_terms"),
    ("reasoning-gym:chain_sum", {"size": 5}, "use env[].args.num_examples instead of 'size'"),
    ("reasoning-gym:chain_sum", {"num_examples": 0}, "num_examples must be a whole number >= 1"),
    ("reasoning-gym", {}, "did you mean 'reasoning-gym:<dataset>'?"),
    ("reasoning_gym:chain_sum", {}, "did you mean the built-in 'reasoning-gym:chain_sum'?"),
    ("reverse_text", {}, "did you mean 'reverse-text'?"),
    ("grpo.envs.math_env", {}, "did you mean 'grpo.envs.math_env:load_environment'?"),
    ("some-registry-env", {}, "pip install 'grpo-rl[verifiers]'"),
]


@pytest.mark.parametrize(("env_id", "args", "expected"), BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_bad_env_input_is_one_clear_value_error(env_id: str, args: dict[str, Any], expected: str) -> None:
    for check in (check_environment, load_environment):
        with pytest.raises(ValueError) as info:
            check(EnvConfig(id=env_id, args=args))
        message = str(info.value)
        assert expected in message and "\n" not in message, message


def test_check_does_not_generate_reasoning_gym_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    import reasoning_gym

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("check_environment generated the dataset")

    monkeypatch.setattr(reasoning_gym, "create_dataset", boom)
    _check("reasoning-gym:sudoku", num_examples=100000)


def test_check_environments_covers_eval_envs() -> None:
    cfg = OrchestratorConfig.model_validate(
        {"env": [{"id": "math"}], "eval": {"env": [{"id": "reverse-text", "args": {"max_word": 3}}]}}
    )
    with pytest.raises(ValueError, match="did you mean 'max_words'"):
        check_environments(cfg)


def test_remote_env_check_needs_no_server() -> None:
    _check_remote = EnvConfig(id="math", address="127.0.0.1:1")
    check_environment(_check_remote)
    with pytest.raises(ValueError, match="args go to the server"):
        check_environment(EnvConfig(id="math", address="127.0.0.1:1", args={"seed": 1}))
    with pytest.raises(ValueError, match="not host:port"):
        check_environment(EnvConfig(id="math", address="nowhere"))


def test_args_of_the_declared_type_are_converted() -> None:
    env = load_environment(
        EnvConfig(id="reasoning-gym:chain_sum", args={"num_examples": "3", "min_terms": 2})
    )
    assert len(env.examples) == 3


def loader_with_required(size: int, *, tag: str = "x") -> SingleTurnEnv:
    return SingleTurnEnv(examples=[{"prompt": tag * size}], rewards=[lambda: 1.0])


def loader_open(**kwargs: Any) -> SingleTurnEnv:
    return SingleTurnEnv(examples=[{"prompt": repr(sorted(kwargs))}], rewards=[lambda: 1.0])


def test_user_loader_args_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown arg 'tga' .*did you mean 'tag'"):
        _check(f"{__name__}:loader_with_required", size=1, tga="y")
    with pytest.raises(ValueError, match="missing required arg 'size'"):
        load_environment(EnvConfig(id=f"{__name__}:loader_with_required"))
    env = load_environment(EnvConfig(id=f"{__name__}:loader_with_required", args={"size": 2, "tag": "y"}))
    assert env.examples[0]["prompt"] == "yy"
    env = load_environment(EnvConfig(id=f"{__name__}:loader_open", args={"anything": 1}))
    assert env.examples[0]["prompt"] == "['anything']"


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{43}", "42", 0.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("The total is 1,234.", "1234", 1.0),
        ("\\boxed{12,345,678}", "12345678", 1.0),
        ("\\boxed{3.5}", "\\frac{7}{2}", 1.0),
        ("\\boxed{\\frac{7}{2}}", "\\frac{7}{2}", 1.0),
        ("$x = -\\frac{7}{2}$", "-\\frac{7}{2}", 1.0),
        ("\\boxed{9}", "-9", 0.0),
        ("no idea", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_math_reward_by_hand(completion: str, answer: str, reward: float) -> None:
    assert math_verify_reward(completion, answer) == reward


def test_reasoning_gym_answer_extraction() -> None:
    assert extract_answer("think <answer> 12 </answer>") == "12"
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{1} or \\boxed{7}") == "7"
    assert extract_answer(" 12 ") == "12"


@pytest.mark.parametrize("task", ["chain_sum", "leg_counting", "basic_arithmetic", "spell_backward"])
def test_reasoning_gym_rewards_right_one_wrong_zero_and_stay_in_range(task: str) -> None:
    env = load_environment(EnvConfig(id=f"reasoning-gym:{task}", args={"num_examples": 3, "seed": 3}))
    for index, example in enumerate(env.examples):
        answer = example["answer"]
        assert _score(env, f"<answer>{answer}</answer>", index) == 1.0
        assert _score(env, f"The answer is \\boxed{{{answer}}}", index) == 1.0
        assert _score(env, "<answer>zzzz</answer>", index) == 0.0
        # partial credit is reasoning-gym's own scoring; it never exceeds 1 (spell_backward overshot)
        assert 0.0 <= _score(env, f"<answer>{answer}x</answer>", index) < 1.0


LOADS: list[str] = []


def loader_counted() -> SingleTurnEnv:
    LOADS.append("built")
    return SingleTurnEnv(examples=[{"prompt": "q"}], rewards=[lambda: 1.0])


def loader_raising(path: str = "missing.csv") -> SingleTurnEnv:
    raise FileNotFoundError(f"no such file: {path}")


def loader_wrong_type() -> dict[str, Any]:
    return {"examples": []}


@pytest.mark.parametrize(
    ("loader", "expected"),
    [
        (
            "loader_raising",
            f"env {__name__}:loader_raising: its loader {__name__}:loader_raising raised FileNotFoundError: "
            "no such file: missing.csv; fix the loader or env[].args",
        ),
        ("loader_wrong_type", "the loader returned dict, which is not an environment"),
    ],
)
def test_the_dry_run_check_runs_user_loaders(loader: str, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        check_environment(EnvConfig(id=f"{__name__}:{loader}"))
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_what_the_check_built_the_run_takes_over() -> None:
    LOADS.clear()
    cfg = EnvConfig(id=f"{__name__}:loader_counted", name="counted")
    check_environment(cfg)
    env = load_environment(cfg)
    assert LOADS == ["built"] and env.name == "counted"
    load_environment(cfg)  # taken once: a second load builds afresh
    assert LOADS == ["built", "built"]
