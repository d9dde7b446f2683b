"""gradient_checkpointing auto and the micro-batch budget: what the activation estimates decide."""

from __future__ import annotations

from dataclasses import replace

import pytest

from grpo.config.trainer import TrainerConfig
from grpo.models.shape import ModelShape
from grpo.trainer.activation_plan import (
    ACTIVATION_SHARE,
    MAX_PLANNED_MICRO_BATCH_TOKENS,
    activation_budget_bytes,
    activation_bytes,
    alive_tokens,
    checkpointing_choice,
    keeps_probabilities,
    planned_micro_batch_tokens,
    resolved_for_memory,
    tokens_without_recompute,
)

GIB = 2**30
# SmolLM2-135M's shape: 30 layers, hidden 576, intermediate 1536.
SHAPE = ModelShape(576, 1536, 30, 9, 3, 64, 49152, tied_embeddings=True)


def _train(**fields: object) -> TrainerConfig:
    return TrainerConfig.model_validate({"model": "m", **fields})


def test_auto_is_the_default_and_is_off_when_every_layers_activations_fit() -> None:
    train = _train()
    assert train.gradient_checkpointing == "auto"
    choice = checkpointing_choice(train, SHAPE, 4096, activation_bytes(SHAPE, 4096, 0))
    assert choice.num_layers == 0
    assert choice.describe(30).startswith("gradient checkpointing off: 4096 tokens")


def test_auto_recomputes_as_few_layers_as_make_the_activations_fit() -> None:
    budget = activation_bytes(SHAPE, 4096, 7)
    choice = checkpointing_choice(_train(), SHAPE, 4096, budget)
    assert choice.num_layers == 7
    assert activation_bytes(SHAPE, 4096, 6) > budget  # six would not do
    assert "the first 7 of 30 layers" in choice.describe(30) and "above" in choice.reason


def test_auto_recomputes_every_layer_when_nothing_less_fits() -> None:
    choice = checkpointing_choice(_train(), SHAPE, 4096, activation_bytes(SHAPE, 4096, 30) // 2)
    assert choice.num_layers == 30 and "even recomputing every layer" in choice.reason


@pytest.mark.parametrize(("setting", "num_layers"), [(True, 30), (False, 0), (4, 4), (99, 30)])
def test_an_explicit_setting_is_kept_whatever_the_memory(setting: bool | int, num_layers: int) -> None:
    train = _train(gradient_checkpointing=setting)
    for budget in (GIB, 1000 * GIB):
        assert checkpointing_choice(train, SHAPE, 4096, budget).num_layers == num_layers


def test_a_negative_layer_count_is_refused() -> None:
    with pytest.raises(ValueError, match="number of layers >= 0"):
        _train(gradient_checkpointing=-1)


def test_the_activations_alive_at_once_are_an_accumulation_group_at_most_a_step() -> None:
    train = _train(micro_batches_per_backward=4)
    assert alive_tokens(train, 1000, None) == 4000
    assert alive_tokens(train, 1000, 2500) == 2500
    assert alive_tokens(train, 1000, 500) == 500


def test_the_activation_budget_is_the_setting_else_a_share_of_the_memory() -> None:
    assert activation_budget_bytes(_train(), 10 * GIB) == int(ACTIVATION_SHARE * 10 * GIB)
    assert activation_budget_bytes(_train(activation_memory_gib=1.5), 10 * GIB) == int(1.5 * GIB)
    budget = activation_bytes(SHAPE, 3000, 0)
    assert tokens_without_recompute(SHAPE, budget) == 3000


def test_the_planned_budget_fills_the_activation_share_between_its_floor_and_ceiling() -> None:
    train = _train(sequence_len=512)
    memory = int(activation_bytes(SHAPE, 3000, 0) / ACTIVATION_SHARE) + 1
    assert planned_micro_batch_tokens(train, SHAPE, memory) == 2816  # a multiple of 256
    assert planned_micro_batch_tokens(train, SHAPE, GIB // 100) == 512  # never below one row
    assert planned_micro_batch_tokens(train, SHAPE, 1000 * GIB) == MAX_PLANNED_MICRO_BATCH_TOKENS
    assert planned_micro_batch_tokens(_train(micro_batch_tokens=777), SHAPE, 1000 * GIB) == 777


def test_a_plan_reserves_what_its_worst_case_needs_and_auto_stays_auto() -> None:
    memory = int(activation_bytes(SHAPE, 8000, 0) / ACTIVATION_SHARE) + 1
    train, choice = resolved_for_memory(_train(sequence_len=512), SHAPE, memory, max_step_tokens=6000)
    assert train.micro_batch_tokens == 7936 and train.gradient_checkpointing == "auto"
    assert choice.num_layers == 0  # the worst case, 6000 tokens alive at once, fits
    assert train.activation_memory_gib == pytest.approx(activation_bytes(SHAPE, 6000, 0) / GIB)
    tight, choice = resolved_for_memory(_train(sequence_len=512), SHAPE, memory, max_step_tokens=20000)
    assert 0 < choice.num_layers < 30
    assert tight.activation_memory_gib == pytest.approx(
        activation_bytes(SHAPE, 20000, choice.num_layers) / GIB
    )
    kept, _ = resolved_for_memory(_train(gradient_checkpointing=True), SHAPE, 1000 * GIB)
    assert kept.gradient_checkpointing is True and kept.activation_memory_gib is None


def _checkpointing(tiny_model_path, **fields: object):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    from grpo.trainer.hf.checkpointing import LayerCheckpointing

    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    cfg = TrainerConfig.model_validate({"model": str(tiny_model_path), **fields})
    checkpointing = LayerCheckpointing(
        causal_lm, cfg, ModelShape.from_folder(tiny_model_path), torch.device("cpu")
    )
    layers = [m for m in causal_lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    return checkpointing, layers


def test_the_hf_model_recomputes_only_the_chosen_layers(tiny_model_path) -> None:
    _, layers = _checkpointing(tiny_model_path, gradient_checkpointing=1)
    assert len(layers) > 1
    assert [layer.gradient_checkpointing for layer in layers] == [True] + [False] * (len(layers) - 1)


def test_auto_decides_for_each_group_of_micro_batches_from_its_tokens(tiny_model_path) -> None:
    shape = ModelShape.from_folder(tiny_model_path)
    budget_gib = activation_bytes(shape, 100, 0) / GIB
    checkpointing, layers = _checkpointing(tiny_model_path, activation_memory_gib=budget_gib)
    assert checkpointing.fit(100) == 0 and not any(layer.gradient_checkpointing for layer in layers)
    assert checkpointing.fit(10_000) == len(layers) and all(layer.gradient_checkpointing for layer in layers)
    assert checkpointing.fit(50) == 0 and not any(layer.gradient_checkpointing for layer in layers)


def test_probabilities_are_kept_for_backward_where_they_fit_beside_the_activations() -> None:
    probabilities = 1536 * SHAPE.vocab_size * 4
    for num_recomputed in (0, 1, 30):
        activations = activation_bytes(SHAPE, 2048, num_recomputed)
        assert keeps_probabilities(SHAPE, 2048, 1536, num_recomputed, activations + probabilities)
        assert not keeps_probabilities(SHAPE, 2048, 1536, num_recomputed, activations + probabilities - 1)


def test_auto_recomputes_a_layer_more_to_keep_the_probabilities_where_the_lm_head_costs_more() -> None:
    # A short-answer step: 1,300 tokens, 1,200 of them loss tokens. Its activations fit with every
    # layer kept, but not beside the probabilities; running the lm_head again over 1,200 tokens costs
    # about eight layers' forward, so auto recomputes the first layer and keeps them.
    probabilities = 1200 * SHAPE.vocab_size * 4
    budget = activation_bytes(SHAPE, 1300, 1) + probabilities
    assert activation_bytes(SHAPE, 1300, 0) <= budget < activation_bytes(SHAPE, 1300, 0) + probabilities
    assert checkpointing_choice(_train(), SHAPE, 1300, budget).num_layers == 0  # loss tokens not said
    choice = checkpointing_choice(_train(), SHAPE, 1300, budget, num_loss_tokens=1200)
    assert choice.num_layers == 1
    assert (
        "1 more layers recomputed make room for keeping the 1200 loss tokens' probabilities" in choice.reason
    )
    assert keeps_probabilities(SHAPE, 1300, 1200, choice.num_layers, budget)
    fits = checkpointing_choice(_train(), SHAPE, 1300, budget + probabilities, num_loss_tokens=1200)
    assert fits.num_layers == 0 and keeps_probabilities(SHAPE, 1300, 1200, 0, budget + probabilities)
    assert fits.reason.endswith("keeping the 1200 loss tokens' probabilities for backward")


def test_auto_recomputes_the_lm_head_rather_than_layers_that_cost_more() -> None:
    # 8,192 tokens with 64 loss tokens: a layer's forward over every token costs more than the lm_head
    # over the loss tokens, so the fewest layers stay and the logits are recomputed instead.
    budget = activation_bytes(SHAPE, 8192, 7)
    choice = checkpointing_choice(_train(), SHAPE, 8192, budget, num_loss_tokens=64)
    assert choice.num_layers == 7 and "probabilities" not in choice.reason
    assert not keeps_probabilities(SHAPE, 8192, 64, 7, budget)


def test_the_hf_trainer_keeps_probabilities_within_its_budget_also_with_checkpointing_off(
    tiny_model_path,
) -> None:
    shape = ModelShape.from_folder(tiny_model_path)
    budget_gib = (activation_bytes(shape, 100, 0) + 80 * shape.vocab_size * 4) / GIB
    for setting in ("auto", False):
        checkpointing, _ = _checkpointing(
            tiny_model_path, gradient_checkpointing=setting, activation_memory_gib=budget_gib
        )
        checkpointing.fit(100)
        assert checkpointing.keeps_probabilities(100, 80)
        assert not checkpointing.keeps_probabilities(100, 81)
    checkpointing, _ = _checkpointing(tiny_model_path, gradient_checkpointing=True)
    checkpointing.fit(100)
    assert not checkpointing.keeps_probabilities(100, 1)


def test_the_hf_trainer_recomputes_a_layer_more_where_that_keeps_the_probabilities(tiny_model_path) -> None:
    shape = ModelShape.from_folder(tiny_model_path)
    probabilities = 80 * shape.vocab_size * 4
    budget = activation_bytes(shape, 100, 1) + probabilities
    assert activation_bytes(shape, 100, 0) <= budget < activation_bytes(shape, 100, 0) + probabilities
    checkpointing, layers = _checkpointing(tiny_model_path, activation_memory_gib=budget / GIB)
    assert checkpointing.fit(100) == 0 and not checkpointing.keeps_probabilities(100, 80)
    assert checkpointing.fit(100, 80) == 1 and checkpointing.keeps_probabilities(100, 80)
    assert [layer.gradient_checkpointing for layer in layers] == [True] + [False] * (len(layers) - 1)


def test_checkpointing_off_keeps_no_probabilities_without_a_planned_budget(tiny_model_path) -> None:
    # Co-located with gradient_checkpointing false the plan sets no activation_memory_gib and the
    # GPU beyond the planned activations is vLLM's: half the device is no budget to keep them in
    # (seen on an H100: 3 GiB above the plan).
    checkpointing, _ = _checkpointing(tiny_model_path, gradient_checkpointing=False)
    checkpointing.fit(100)
    assert checkpointing.budget_bytes > 1 * GIB
    assert not checkpointing.keeps_probabilities(100, 1)
    auto, _ = _checkpointing(tiny_model_path)
    auto.fit(100)
    assert auto.keeps_probabilities(100, 1)


def test_a_float32_trainers_activations_are_planned_at_twice_a_bfloat16_ones() -> None:
    float32 = replace(SHAPE, activation_value_bytes=4)
    for num_recomputed in (0, 7, 30):
        assert activation_bytes(float32, 2048, num_recomputed) == 2 * activation_bytes(
            SHAPE, 2048, num_recomputed
        )
    budget = 4 * GIB
    assert tokens_without_recompute(float32, budget) == tokens_without_recompute(SHAPE, budget) // 2
    # the same tokens need more layers recomputed to fit the same budget in float32
    train = _train()
    bf16_layers = checkpointing_choice(train, SHAPE, 8192, budget).num_layers
    assert checkpointing_choice(train, float32, 8192, budget).num_layers > bf16_layers
