"""What a CPU engine's start says about its dtype: why auto is float32 on a CPU, and a warning when
16 bits are asked for on one without native 16-bit matmuls."""

from __future__ import annotations

import logging

import pytest

from grpo.config.inference import InferenceConfig
from grpo.inference.server import _log_cpu_dtype


@pytest.fixture
def cpu_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("grpo.utils.device.cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr("grpo.utils.device.cuda_present", lambda: False)


@pytest.fixture
def cpu_with_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("grpo.utils.device.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("grpo.utils.device.cuda_present", lambda: False)


@pytest.mark.usefixtures("cpu_without_bf16")
def test_auto_on_a_cpu_without_bf16_says_it_runs_float32_and_how_to_force_16_bits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="grpo"):
        _log_cpu_dtype(InferenceConfig(model="m"), "float32")
    assert "dtype auto: float32" in caplog.text and "set dtype: bfloat16" in caplog.text


@pytest.mark.usefixtures("cpu_without_bf16")
def test_bfloat16_asked_for_on_a_cpu_without_bf16_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="grpo"):
        _log_cpu_dtype(InferenceConfig(model="m", dtype="bfloat16"), "bfloat16")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "~80x slower" in record.getMessage()


@pytest.mark.usefixtures("cpu_with_bf16")
def test_auto_says_float32_on_a_cpu_with_bf16_too(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="grpo"):
        _log_cpu_dtype(InferenceConfig(model="m"), "float32")
    assert "dtype auto: float32 on CPU" in caplog.text and "~80x" not in caplog.text


@pytest.mark.usefixtures("cpu_with_bf16")
def test_a_16_bit_engine_on_a_cpu_with_bf16_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="grpo"):
        _log_cpu_dtype(InferenceConfig(model="m", dtype="bfloat16"), "bfloat16")
    assert caplog.records == []


@pytest.mark.usefixtures("cpu_without_bf16")
def test_auto_with_quantized_weights_on_a_cpu_without_bf16_claims_no_float32(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="grpo"):
        _log_cpu_dtype(InferenceConfig(model="m", quantization="fp8_per_block"), "auto")
    assert caplog.records == []
