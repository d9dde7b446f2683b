"""The CPU engine's float32 head: the lm_head's float32 copy is made once and made again after
every weight update, and the logits are the float32 product vLLM's cast-every-step path computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from grpo.inference.vllm_compat.cpu_float32_head import (
    CACHE_ATTRIBUTE,
    forget_float32_heads,
    keep_float32_cpu_head,
)
from grpo.inference.worker_extension import WorkerExtension

pytest.importorskip("vllm")


def _lm_head(vocab: int = 96, hidden: int = 16) -> torch.nn.Module:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    head = torch.nn.Module()
    head.weight = torch.nn.Parameter(torch.randn(vocab, hidden).bfloat16(), requires_grad=False)
    head.quant_method = UnquantizedEmbeddingMethod()
    return head


def _float32_processor():  # a LogitsProcessor of an engine started with head_dtype float32
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    keep_float32_cpu_head()
    with set_current_vllm_config(VllmConfig()):
        processor = LogitsProcessor(96)
    processor.head_dtype = torch.float32
    return processor


def _assert_float32_product(logits: torch.Tensor, head: torch.nn.Module, hidden: torch.Tensor) -> None:
    """float32 logits of the head's current weight: its float64 product rounded once, give or take
    the float32 accumulation (a bf16 logit would be off by up to 1/32 at these sizes)."""
    reference = hidden.double() @ head.weight.double().t()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), reference, rtol=0, atol=1e-5)


def test_float32_logits_are_the_float32_product_and_the_weight_is_copied_once() -> None:
    torch.manual_seed(0)
    processor, head = _float32_processor(), _lm_head()
    hidden = torch.randn(5, 16).bfloat16()

    first = processor._apply_head(head, hidden, None)
    kept = head.__dict__[CACHE_ATTRIBUTE][1]
    second = processor._apply_head(head, hidden, None)

    _assert_float32_product(first, head, hidden)
    assert torch.equal(second, first)
    assert head.__dict__[CACHE_ATTRIBUTE][1] is kept
    assert kept.dtype == torch.float32 and torch.equal(kept, head.weight.float())


def test_an_updated_weight_is_used_once_the_copies_are_forgotten_and_a_replaced_one_at_once() -> None:
    torch.manual_seed(1)
    processor, head = _float32_processor(), _lm_head()
    hidden = torch.randn(3, 16).bfloat16()
    processor._apply_head(head, hidden, None)
    model = torch.nn.Sequential(head)

    with torch.no_grad():
        head.weight.data.copy_(torch.randn(96, 16).bfloat16())  # in place, as vLLM's loaders write
    assert forget_float32_heads(model) == 1
    _assert_float32_product(processor._apply_head(head, hidden, None), head, hidden)

    head.weight = torch.nn.Parameter(torch.randn(96, 16).bfloat16(), requires_grad=False)
    _assert_float32_product(processor._apply_head(head, hidden, None), head, hidden)


def test_a_head_in_the_model_dtype_or_a_float32_model_is_left_to_vllm() -> None:
    processor, head = _float32_processor(), _lm_head()
    # vLLM's CPU GEMM dispatch gives each layer its kernel; these heads go through it
    head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    float32_head = _lm_head()
    float32_head.weight.data = float32_head.weight.data.float()
    float32_head.cpu_linear = head.cpu_linear

    out32 = processor._apply_head(float32_head, torch.randn(2, 16), None)
    processor.head_dtype = torch.bfloat16
    out16 = processor._apply_head(head, torch.randn(2, 16).bfloat16(), None)

    assert (out32.dtype, out16.dtype) == (torch.float32, torch.bfloat16)
    assert CACHE_ATTRIBUTE not in head.__dict__ and CACHE_ATTRIBUTE not in float32_head.__dict__


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = _lm_head()

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.get_parameter(name).data.copy_(tensor)


class _Worker:
    def __init__(self, model: _Model) -> None:
        self.model = model

    def _grpo_model(self) -> _Model:
        return self.model


def test_a_full_weight_load_from_a_folder_forgets_the_float32_head(tmp_path: Path) -> None:
    processor, model = _float32_processor(), _Model()
    hidden = torch.randn(2, 16).bfloat16()
    processor._apply_head(model.lm_head, hidden, None)
    save_file({"lm_head.weight": torch.randn(96, 16).bfloat16()}, str(tmp_path / "w.safetensors"))

    assert WorkerExtension.load_weights_from_path(_Worker(model), str(tmp_path)) == 1  # type: ignore[arg-type]

    assert CACHE_ATTRIBUTE not in model.lm_head.__dict__
    _assert_float32_product(processor._apply_head(model.lm_head, hidden, None), model.lm_head, hidden)
