"""The Megatron layout checks that need the model's shape and the world size."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from grpo.config.megatron import MegatronConfig
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
