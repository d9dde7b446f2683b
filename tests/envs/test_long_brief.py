from __future__ import annotations

import asyncio
from pathlib import Path

from grpo.config.orchestrator import EnvConfig
from grpo.envs import Environment, load_environment
from grpo.envs.long_brief import BRIEF


def _score(env: Environment, completion: str) -> float:
    score = asyncio.run(env.score(env.examples[0], [{"role": "assistant", "content": completion}], {}))
    assert not score.failed, score.failure
    return score.reward


def test_long_brief_loads_by_id_with_args() -> None:
    env = load_environment(EnvConfig(id="long-brief", args={"num_examples": 7, "seed": 3}))
    assert len(env.examples) == 7 and env.name == "long-brief"


def test_every_prompt_starts_with_the_same_brief() -> None:
    env = load_environment(EnvConfig(id="long-brief", args={"num_examples": 20}))
    systems = {env.prompt_messages(example)[0]["content"] for example in env.examples}
    assert systems == {BRIEF}


def test_prompts_are_about_350_tokens_with_a_shared_prefix(embedded_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path)
    assert 330 <= len(tokenizer(BRIEF)["input_ids"]) <= 370
    env = load_environment(EnvConfig(id="long-brief", args={"num_examples": 20}))
    prompts = [
        tokenizer.apply_chat_template(
            env.prompt_messages(example), add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for example in env.examples
    ]
    assert all(340 <= len(ids) <= 400 for ids in prompts), [len(ids) for ids in prompts]
    # the brief is a token prefix every prompt shares: what prefix caching and sharing rely on
    shared = 0
    while all(len(ids) > shared and ids[shared] == prompts[0][shared] for ids in prompts):
        shared += 1
    assert shared >= 340


def test_reward_is_short_answers() -> None:
    env = load_environment(EnvConfig(id="long-brief", args={"num_examples": 1}))
    answer = env.examples[0]["answer"]
    assert _score(env, answer) == 1.0
    assert _score(env, f"The answer is {answer}.") < 1.0
    assert _score(env, "qwertyuiop") == 0.5
