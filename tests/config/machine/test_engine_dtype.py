"""infer dtype: what the engine runs in on each device, and float32 LoRA serving refused on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config.across_files.crosscheck import check_colocated
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.loading import load_config
from grpo.config.machine.engine_dtype import dtype_problems, merging_is_exact, resolve_engine_dtype
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig
from grpo.inference.server_args import build_server_args

REPO = Path(__file__).resolve().parents[3]
SHIPPED_INFER = sorted(p for d in ("configs", "examples") for p in (REPO / d).rglob("infer*.yaml"))


@pytest.mark.parametrize(
    "dtype, on_cuda, engine",
    [
        ("float32_on_cpu", False, "float32"),
        ("float32_on_cpu", True, "bfloat16"),
        ("auto", True, "auto"),
        ("auto", False, "float32"),
        ("float32", False, "float32"),
        ("bfloat16", False, "bfloat16"),
    ],
)
def test_the_engine_dtype_depends_on_the_device_for_float32_on_cpu_and_auto(
    dtype: str, on_cuda: bool, engine: str
) -> None:
    cfg = InferenceConfig(model="m", dtype=dtype)  # type: ignore[arg-type]
    assert resolve_engine_dtype(cfg, on_cuda) == engine


def test_auto_stays_vllms_choice_for_quantized_weights_on_a_cpu() -> None:
    cfg = InferenceConfig(model="m", quantization="fp8_per_block")
    assert resolve_engine_dtype(cfg, on_cuda=False) == "auto"


@pytest.mark.parametrize(
    "dtype, on_cuda, exact",
    [
        ("auto", False, True),
        ("float32_on_cpu", False, True),
        ("bfloat16", False, False),
        ("auto", True, False),
    ],
)
def test_merging_a_lora_update_into_the_served_weights_is_exact_only_in_float32(
    dtype: str, on_cuda: bool, exact: bool
) -> None:
    assert merging_is_exact(InferenceConfig(model="m", dtype=dtype), on_cuda) is exact  # type: ignore[arg-type]


def test_a_bfloat16_merge_drops_a_small_lora_update_that_float32_keeps() -> None:
    """Why merging_is_exact says no to 16 bits: base + delta rounded to the base's bfloat16 grid is
    the base again wherever the delta is below half a step of it."""
    import torch

    from grpo.inference.lora_merge import LowRankUpdate, merged_weight

    generator = torch.Generator().manual_seed(0)
    base = (torch.randn(64, 64, generator=generator) * 0.03).to(torch.bfloat16)
    update = LowRankUpdate(
        row_offset=0,
        lora_a=torch.randn(4, 64, generator=generator) * 0.1,
        lora_b=torch.full((64, 4), 1e-4),
        scaling=2.0,
    )
    delta = update.scaling * update.lora_b @ update.lora_a
    served_bf16 = merged_weight(base, [update]).float() - base.float()
    served_fp32 = merged_weight(base.float(), [update]) - base.float()
    assert (served_bf16 - delta).norm() > 0.5 * delta.norm()  # most of the update is lost
    assert (served_fp32 - delta).norm() < 1e-3 * delta.norm()  # float32 keeps it


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
