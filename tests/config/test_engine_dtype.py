"""infer dtype: what the engine runs in on each device, and float32 LoRA serving refused on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config.crosscheck import check_colocated
from grpo.config.engine_dtype import dtype_problems, resolve_engine_dtype
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.loading import load_config
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig
from grpo.inference.server_args import build_server_args

REPO = Path(__file__).resolve().parents[2]
SHIPPED_INFER = sorted(p for d in ("configs", "examples") for p in (REPO / d).rglob("infer*.yaml"))


@pytest.mark.parametrize(
    "dtype, on_cuda, cpu_bf16, engine",
    [
        ("float32_on_cpu", False, True, "float32"),
        ("float32_on_cpu", True, True, "bfloat16"),
        ("auto", True, False, "auto"),
        ("auto", False, True, "auto"),
        ("float32", False, True, "float32"),
        ("bfloat16", False, True, "bfloat16"),
        ("bfloat16", False, False, "bfloat16"),
    ],
)
def test_the_engine_dtype_depends_on_the_device_for_float32_on_cpu_and_auto(
    dtype: str, on_cuda: bool, cpu_bf16: bool, engine: str
) -> None:
    cfg = InferenceConfig(model="m", dtype=dtype)  # type: ignore[arg-type]
    assert resolve_engine_dtype(cfg, on_cuda, cpu_bf16=cpu_bf16) == engine


def test_auto_is_float32_on_a_cpu_without_native_16_bit_matmuls() -> None:
    assert resolve_engine_dtype(InferenceConfig(model="m"), on_cuda=False, cpu_bf16=False) == "float32"


def test_auto_stays_vllms_choice_for_quantized_weights_on_a_cpu_without_bf16() -> None:
    cfg = InferenceConfig(model="m", quantization="fp8_per_block")
    assert resolve_engine_dtype(cfg, on_cuda=False, cpu_bf16=False) == "auto"


def test_auto_asks_this_cpu_when_not_told(monkeypatch: pytest.MonkeyPatch) -> None:
    for native, engine in ((False, "float32"), (True, "auto")):
        monkeypatch.setattr("grpo.utils.device.cpu_has_native_bf16", lambda native=native: native)
        assert resolve_engine_dtype(InferenceConfig(model="m"), on_cuda=False) == engine


def test_vllm_gets_the_resolved_dtype() -> None:
    cfg = InferenceConfig(model="m", dtype="float32_on_cpu")
    for on_cpu, engine in ((True, "float32"), (False, "bfloat16")):
        argv = build_server_args(cfg, "/m", on_cpu=on_cpu)
        assert argv[argv.index("--dtype") + 1] == engine


def test_float32_with_lora_adapters_is_refused_on_a_gpu_in_one_line() -> None:
    (line,) = dtype_problems(InferenceConfig(model="m", dtype="float32", enable_lora=True), on_cuda=True)
    assert "float32" in line and "set dtype: bfloat16" in line
    assert dtype_problems(InferenceConfig(model="m", dtype="float32", enable_lora=True), on_cuda=False) == []
    assert dtype_problems(InferenceConfig(model="m", dtype="float32", enable_lora=False), on_cuda=True) == []


def test_a_float32_lora_run_is_refused_at_load_for_a_gpu() -> None:
    demo = REPO / "configs/demo"
    train = load_config(TrainerConfig, demo / "train.yaml")
    orch = load_config(OrchestratorConfig, demo / "orch.yaml")
    infer = load_config(InferenceConfig, demo / "infer.yaml").model_copy(update={"dtype": "float32"})
    with pytest.raises(ConfigError, match="set dtype: bfloat16"):
        check_colocated(train, infer, orch, on_cuda=True)


@pytest.mark.parametrize("path", SHIPPED_INFER, ids=lambda p: str(p.relative_to(REPO)))
@pytest.mark.parametrize("on_cuda", [False, True], ids=["cpu", "cuda"])
def test_every_shipped_engine_runs_lora_in_a_dtype_its_device_takes(path: Path, on_cuda: bool) -> None:
    cfg = load_config(InferenceConfig, path)
    assert dtype_problems(cfg, on_cuda) == []
    if on_cuda and cfg.enable_lora:
        assert resolve_engine_dtype(cfg, on_cuda) in ("auto", "bfloat16", "float16")
