from __future__ import annotations

import asyncio

import pytest

from grpo.config.orchestrator import EnvConfig
from grpo.envs import Environment, load_environment


def _score(env: Environment, completion: str) -> float:
    score = asyncio.run(env.score(env.examples[0], [{"role": "assistant", "content": completion}], {}))
    assert not score.failed, score.failure
    return score.reward


def test_reverse_text_scores_the_reversal_one_and_others_lower() -> None:
    env = load_environment(EnvConfig(id="reverse-text", args={"num_examples": 10}))
    assert len(env.examples) == 10
    text = env.examples[0]["prompt"]
    assert _score(env, text[::-1]) == 1.0
    assert _score(env, text) < 1.0 or text == text[::-1]


def test_math_verifies_correct_answers() -> None:
    env = load_environment(EnvConfig(id="math", args={"num_examples": 5, "seed": 1}))
    answer = env.examples[0]["answer"]
    assert _score(env, f"The answer is \\boxed{{{answer}}}.") == 1.0
    assert _score(env, "The answer is \\boxed{123456789}.") == 0.0


def test_reasoning_gym_task_works_offline() -> None:
    env = load_environment(EnvConfig(id="reasoning-gym:leg_counting", args={"num_examples": 3}))
    answer = env.examples[0]["answer"]
    assert _score(env, f"<answer>{answer}</answer>") == 1.0
    assert _score(env, "<answer>-1</answer>") < 1.0


def make_env(size: int) -> object:
    from grpo.envs import SingleTurnEnv

    return SingleTurnEnv(examples=[{"prompt": str(i)} for i in range(size)], rewards=[lambda: 1.0])


def test_import_path_loader_gets_args_and_display_name() -> None:
    env = load_environment(EnvConfig(id=f"{__name__}:make_env", name="mine", args={"size": 3}))
    assert len(env.examples) == 3 and env.name == "mine"


def test_unknown_ids_are_value_errors() -> None:
    with pytest.raises(ValueError, match="verifiers"):
        load_environment(EnvConfig(id="some-registry-env"))
    with pytest.raises(ValueError, match="no module named 'no_such_pkg'"):
        load_environment(EnvConfig(id="no_such_pkg.envs:load"))
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_environment(EnvConfig(id=f"{__name__}:nope"))
