"""reward_model: a sequence-classification model's logit as the reward, in batches."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from grpo.config.orchestrator import EnvConfig
from grpo.config.sections.judges import RewardModelConfig
from grpo.envs import MultiTurnEnv, load_environment
from grpo.envs.extra_rewards import add_extra_rewards
from grpo.envs.reward_model import RewardModel, conversation
from grpo.utils.errors import UserError


@pytest.fixture(scope="module")
def tiny_reward_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer random LlamaForSequenceClassification (one label) with the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("reward-model")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _direct_scores(path: Path, pairs: list[tuple[Any, str]]) -> list[float]:
    """Each pair alone through the model (no padding): what a batch must reproduce."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt, reply in pairs:
        text = tokenizer.apply_chat_template(conversation(prompt, reply), tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out.append(float(model(**ids).logits[0, 0]))
    return out


PAIRS: list[tuple[Any, str]] = [
    ("What is 2+2?", "4"),
    ([{"role": "user", "content": "Name a colour."}], "A rather long answer: blue, like the sky at noon."),
    ("Say hi.", "hi"),
]


def test_batched_scores_equal_a_direct_forward_of_each_pair(tiny_reward_model: Path) -> None:
    model = RewardModel(RewardModelConfig(path=str(tiny_reward_model), batch_size=2))
    scores = asyncio.run(model.score(PAIRS))
    assert scores == pytest.approx(_direct_scores(tiny_reward_model, PAIRS), abs=1e-4)


def test_an_env_blocks_reward_model_is_its_own_metric(tiny_reward_model: Path) -> None:
    env = load_environment(EnvConfig(id="short-answer", reward_model=str(tiny_reward_model)))
    example = env.examples[0]
    reply = [{"role": "assistant", "content": "4"}]
    score = asyncio.run(env.score(example, reply, {}))
    (expected,) = _direct_scores(tiny_reward_model, [(example["prompt"], "4")])
    assert score.metrics["reward_model"] == pytest.approx(expected, abs=1e-4)


def test_a_multi_turn_env_scores_each_rollout_alone(tiny_reward_model: Path) -> None:
    env = MultiTurnEnv([{"prompt": "hi"}], [lambda completion: 0.0], max_turns=3)
    add_extra_rewards(
        env, EnvConfig(id="x", reward_model={"path": str(tiny_reward_model), "weight": 2.0}), "env x"
    )
    score = asyncio.run(env.score(env.examples[0], [{"role": "assistant", "content": "yo"}], {}))
    (expected,) = _direct_scores(tiny_reward_model, [("hi", "yo")])
    assert score.reward == pytest.approx(2.0 * expected, abs=1e-4)


def test_a_model_that_is_not_sequence_classification_is_refused_in_one_line(tiny_model_path: Path) -> None:
    with pytest.raises(UserError) as info:
        load_environment(EnvConfig(id="short-answer", reward_model=str(tiny_model_path)))
    message = str(info.value)
    assert "LlamaForCausalLM, not a sequence-classification model" in message and "\n" not in message
