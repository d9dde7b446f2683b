"""The Megatron layout checks that need the model's shape and the world size."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from grpo.config.sections.megatron import MegatronConfig
from grpo.trainer.megatron.parallel import check_layout
from grpo.utils.errors import UserError


def _llama(**overrides: Any) -> SimpleNamespace:
    fields = {
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
    }
    return SimpleNamespace(**{**fields, **overrides})


def test_a_layout_that_splits_evenly_passes() -> None:
    check_layout(MegatronConfig(tensor_model_parallel_size=3, pipeline_model_parallel_size=2), _llama(), 12)


@pytest.mark.parametrize(
    ("mp", "config", "world_size", "expected"),
    [
        ({"tensor_model_parallel_size": 2}, {}, 2, "9 attention heads and 3 KV heads"),
        ({"tensor_model_parallel_size": 3}, {"num_key_value_heads": 1}, 3, "1 KV heads"),
        ({"pipeline_model_parallel_size": 4}, {}, 4, "30 layers"),
        ({"tensor_model_parallel_size": 3}, {}, 4, "multiple of 3"),
    ],
)
def test_a_layout_that_cannot_split_the_model_is_refused_in_one_line(
    mp: dict[str, int], config: dict[str, Any], world_size: int, expected: str
) -> None:
    with pytest.raises(UserError) as err:
        check_layout(MegatronConfig(**mp), _llama(**config), world_size)
    assert expected in str(err.value) and "\n" not in str(err.value)


def _qwen3_moe(**overrides: Any) -> SimpleNamespace:
    return _llama(architectures=["Qwen3MoeForCausalLM"], num_experts=4, **overrides)


def test_experts_split_over_ranks_that_divide_them_pass() -> None:
    check_layout(MegatronConfig(expert_model_parallel_size=2), _qwen3_moe(), 2)
    check_layout(MegatronConfig(expert_model_parallel_size=4), _qwen3_moe(), 8)


@pytest.mark.parametrize(
    ("ep", "config", "world_size", "expected"),
    [
        (2, _llama(), 2, "the model has no mixture-of-experts layers; set expert_model_parallel_size: 1"),
        (3, _qwen3_moe(), 3, "must divide the model's 4 experts"),
        (4, _qwen3_moe(), 2, "launch a multiple of 4 ranks"),
    ],
)
def test_an_expert_split_the_model_or_the_ranks_cannot_take_is_refused_in_one_line(
    ep: int, config: SimpleNamespace, world_size: int, expected: str
) -> None:
    with pytest.raises(UserError) as err:
        check_layout(MegatronConfig(expert_model_parallel_size=ep), config, world_size)
    assert expected in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"gpus": 2, "megatron": {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2}},
         "implemented with tensor_model_parallel_size 1 and pipeline_model_parallel_size 1"),
        ({"gpus": 4, "megatron": {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2}},
         "implemented with tensor_model_parallel_size 1"),
        ({"gpus": 3, "megatron": {"expert_model_parallel_size": 2}}, "gpus 3 is not a multiple of megatron expert_model_parallel_size 2"),
    ],
)  # fmt: skip
def test_expert_parallel_layouts_not_implemented_are_refused_at_load(
    fields: dict[str, Any], expected: str
) -> None:
    from grpo.config.trainer import TrainerConfig

    with pytest.raises(ValueError, match=expected):
        TrainerConfig(model="m", backend="megatron", lora=False, **fields)
    assert TrainerConfig(model="m").megatron.expert_model_parallel_size == 1
