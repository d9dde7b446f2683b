"""benchmarks/trainer_profile.py: which heading of the split each profiled operator's time goes to."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from trainer_profile import heading, split

VOCAB, RANK = 151936, 16


@pytest.mark.parametrize(
    ("name", "shapes", "on_cuda", "expected"),
    [
        ("aten::mm", [[16384, 2560], [2560, 9728]], True, "decoder linears"),
        ("aten::mm", [[16384, 2560], [2560, 16]], True, "lora"),  # x @ A^T
        ("aten::mm", [[16, 16384], [16384, 2560]], True, "lora"),  # A's gradient
        ("aten::mm", [[1024, 2560], [2560, VOCAB]], True, "logits/logprobs"),
        ("aten::_log_softmax", [[1024, VOCAB]], True, "logits/logprobs"),
        ("aten::_scaled_dot_product_efficient_attention", [[1, 32, 2048, 128]], True, "attention"),
        ("aten::_flash_attention_backward", [], True, "attention"),
        ("Torch-Compiled Region: 0/0", [], True, "attention"),  # FlexAttention, compiled by transformers
        ("Torch-Compiled Region: 0/0", [], False, "other"),  # grpo's fused CPU ops
        ("aten::_foreach_mul_", [[2560, 16]], True, "optimizer"),
        ("aten::mul", [[16384, 2560]], True, "other"),
    ],
)
def test_each_operator_is_filed_by_its_name_and_shapes(name, shapes, on_cuda, expected):
    assert heading(name, shapes, VOCAB, RANK, on_cuda) == expected


@dataclass
class _Event:
    key: str
    input_shapes: list[list[int]] = field(default_factory=list)
    self_device_time_total: float = 0.0
    self_cpu_time_total: float = 0.0


def test_host_gaps_are_the_wall_time_no_device_operator_filled():
    events = [
        _Event("aten::mm", [[8, 64], [64, 64]], self_device_time_total=300_000, self_cpu_time_total=5),
        _Event("aten::mm", [[8, 64], [64, 16]], self_device_time_total=100_000, self_cpu_time_total=5),
    ]
    seconds = split(events, wall_s=0.5, vocab=VOCAB, lora_rank=RANK, on_cuda=True)
    assert seconds["decoder linears"] == pytest.approx(0.3) and seconds["lora"] == pytest.approx(0.1)
    assert seconds["host gaps"] == pytest.approx(0.1)
