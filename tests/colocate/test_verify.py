"""The start-up check of borrowed weights against the checkpoint: equal passes, a tampered, emptied
or re-laid-out engine weight stops the run in one line naming the weight and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.colocate.verify import verify_against_checkpoint, verify_fp8_against_checkpoint
from grpo.trainer.hf.quantized_base import quantize_fp8_block
from grpo.utils.errors import UserError

FIX = "run co-located on a vLLM in the tested range (>=0.32,<0.33) with quantization null or fp8_per_block"


def _linears(model_path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return {name: t for name, t in tensors.items() if name.endswith("proj.weight")}


def _refusal(error: pytest.ExceptionInfo[UserError]) -> str:
    (line,) = str(error.value).splitlines()
    assert FIX in line
    return line


def test_borrowed_weights_equal_to_the_checkpoint_pass_with_a_spread_checked(tiny_model_path: Path) -> None:
    borrowed = _linears(tiny_model_path)
    checked = verify_against_checkpoint(borrowed, tiny_model_path)
    assert sorted(borrowed)[0] in checked and sorted(borrowed)[-1] in checked
    assert len(checked) >= 4


def test_an_engine_in_another_dtype_is_compared_in_its_own_dtype(tiny_model_path: Path) -> None:
    borrowed = {name: t.to(torch.bfloat16) for name, t in _linears(tiny_model_path).items()}
    assert verify_against_checkpoint(borrowed, tiny_model_path)


def test_a_tampered_row_stops_the_run_naming_the_weight_and_the_row(tiny_model_path: Path) -> None:
    borrowed = _linears(tiny_model_path)
    last = sorted(borrowed)[-1]  # always among the checked
    borrowed[last] = borrowed[last].clone()
    borrowed[last][3] += 0.5
    with pytest.raises(UserError) as error:
        verify_against_checkpoint(borrowed, tiny_model_path)
    line = _refusal(error)
    assert (
        f"borrowed weight {last} is not the checkpoint's (1 of {borrowed[last].shape[0]} rows differ" in line
    )
    assert "the first at row 3, by up to 0.5" in line


def test_a_weight_the_engine_emptied_after_loading_stops_the_run(tiny_model_path: Path) -> None:
    borrowed = _linears(tiny_model_path)
    last = sorted(borrowed)[-1]
    shape = list(borrowed[last].shape)
    borrowed[last] = torch.empty(0)
    with pytest.raises(UserError) as error:
        verify_against_checkpoint(borrowed, tiny_model_path)
    assert f"(engine shape [0], checkpoint {shape})" in _refusal(error)


def test_fp8_weights_within_rounding_pass_and_a_tampered_scale_stops_the_run(tiny_model_path: Path) -> None:
    quantized = {
        name.removesuffix(".weight"): quantize_fp8_block(t) for name, t in _linears(tiny_model_path).items()
    }
    assert verify_fp8_against_checkpoint(quantized, tiny_model_path)
    last = sorted(quantized)[-1]
    quantized[last].scale.mul_(2.0)
    with pytest.raises(UserError) as error:
        verify_fp8_against_checkpoint(quantized, tiny_model_path)
    assert f"borrowed weight {last} is not the checkpoint's (dequantized FP8 differs by" in _refusal(error)
