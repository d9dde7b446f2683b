"""gradient_checkpointing auto and the micro-batch budget: what the activation estimates decide."""

from __future__ import annotations

import pytest

from grpo.config.trainer import TrainerConfig
from grpo.models.shape import ModelShape
from grpo.trainer.activation_plan import (
    ACTIVATION_SHARE,
    MAX_PLANNED_MICRO_BATCH_TOKENS,
    activation_bytes,
    alive_tokens,
    checkpointing_choice,
    planned_micro_batch_tokens,
    resolved_for_memory,
)

GIB = 2**30
# SmolLM2-135M's shape: 30 layers, hidden 576, intermediate 1536.
SHAPE = ModelShape(576, 1536, 30, 9, 3, 64, 49152, tied_embeddings=True)


def _train(**fields: object) -> TrainerConfig:
    return TrainerConfig.model_validate({"model": "m", **fields})


def _memory_for(num_tokens: int, num_recomputed: int) -> int:
    """The memory whose activation share holds exactly these activations."""
    return int(activation_bytes(SHAPE, num_tokens, num_recomputed) / ACTIVATION_SHARE) + 1


def test_auto_is_the_default_and_is_off_when_every_layers_activations_fit() -> None:
    train = _train()
    assert train.gradient_checkpointing == "auto"
    choice = checkpointing_choice(train, SHAPE, 4096, _memory_for(4096, 0))
    assert choice.num_layers == 0
    assert choice.describe(30).startswith("gradient checkpointing off: 4096 tokens")


def test_auto_recomputes_as_few_layers_as_make_the_activations_fit() -> None:
    train = _train()
    memory = _memory_for(4096, 7)
    choice = checkpointing_choice(train, SHAPE, 4096, memory)
    assert choice.num_layers == 7
    assert activation_bytes(SHAPE, 4096, 6) > ACTIVATION_SHARE * memory  # six would not do
    assert "the first 7 of 30 layers" in choice.describe(30) and "exceed" in choice.reason


def test_auto_recomputes_every_layer_when_nothing_less_fits() -> None:
    choice = checkpointing_choice(_train(), SHAPE, 4096, _memory_for(4096, 30) // 2)
    assert choice.num_layers == 30 and "even recomputing every layer" in choice.reason


@pytest.mark.parametrize(("setting", "num_layers"), [(True, 30), (False, 0), (4, 4), (99, 30)])
def test_an_explicit_setting_is_kept_whatever_the_memory(setting: bool | int, num_layers: int) -> None:
    train = _train(gradient_checkpointing=setting)
    for memory in (GIB, 1000 * GIB):
        assert checkpointing_choice(train, SHAPE, 4096, memory).num_layers == num_layers


def test_a_negative_layer_count_is_refused() -> None:
    with pytest.raises(ValueError, match="number of layers >= 0"):
        _train(gradient_checkpointing=-1)


def test_the_activations_alive_at_once_are_an_accumulation_group_at_most_a_step() -> None:
    train = _train(gradient_accumulation_steps=4)
    assert alive_tokens(train, 1000, None) == 4000
    assert alive_tokens(train, 1000, 2500) == 2500
    assert alive_tokens(train, 1000, 500) == 1000


def test_the_planned_budget_fills_the_activation_share_between_its_floor_and_ceiling() -> None:
    train = _train(sequence_len=512, per_device_train_batch_size=2)
    assert planned_micro_batch_tokens(train, SHAPE, _memory_for(3000, 0)) == 2816  # a multiple of 256
    assert planned_micro_batch_tokens(train, SHAPE, GIB // 100) == 1024  # never below 2 rows of 512
    assert planned_micro_batch_tokens(train, SHAPE, 1000 * GIB) == MAX_PLANNED_MICRO_BATCH_TOKENS
    assert planned_micro_batch_tokens(_train(micro_batch_tokens=777), SHAPE, 1000 * GIB) == 777


def test_resolving_for_memory_sets_the_budget_and_the_layer_count() -> None:
    train = resolved_for_memory(_train(sequence_len=512), SHAPE, _memory_for(2048, 0), max_step_tokens=2048)
    assert train.micro_batch_tokens == 2048 and train.gradient_checkpointing == 0
    kept = resolved_for_memory(_train(gradient_checkpointing=True), SHAPE, 1000 * GIB)
    assert kept.gradient_checkpointing is True


def test_the_hf_model_recomputes_only_the_chosen_layers(tiny_model_path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    from grpo.trainer.hf.checkpointing import enable_checkpointing

    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    enable_checkpointing(causal_lm, 1)
    layers = [m for m in causal_lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) > 1
    assert [layer.gradient_checkpointing for layer in layers] == [True] + [False] * (len(layers) - 1)
