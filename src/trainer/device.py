"""The trainer's device and compute dtype, and the precision checks made before anything loads:
one choice for both backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.utils.device import cpu_has_native_bf16
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import TrainerConfig


def resolve_device(cfg: TrainerConfig) -> torch.device:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer device: cuda but no CUDA device is visible; use device: auto or cpu")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def check_precision_support(cfg: TrainerConfig, device: torch.device) -> None:
    """Fail at start (not mid-run) when a recipe or quantization needs hardware that is absent
    (fp8_hybrid: FP8 tensor cores, SM89+; nvfp4 is refused when the config loads).

    qlora_fp8 is weight-only (FP8 storage, matmuls in bf16/fp32), so it runs on any device.
    """
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    # (what, the compute capability it needs, whether this trainer implements it)
    needs: list[tuple[str, tuple[int, int], bool]] = []
    if cfg.recipe == "fp8_hybrid":
        needs.append(("recipe fp8_hybrid", (8, 9), True))
    if cfg.qlora_fp4:
        needs.append(("qlora_fp4", (10, 0), False))
    for what, (major, minor), implemented in needs:
        if capability is None or capability < (major, minor):
            found = f"SM{capability[0]}{capability[1]}" if capability else device.type.upper()
            raise UserError(
                f"{what} needs a CUDA GPU with compute capability SM{major}{minor}+, found {found}; "
                "use recipe: bf16 with qlora_fp8 (weight-only FP8, any device), qlora_bnb (NF4) or plain LoRA"
            )
        if not implemented:
            raise UserError(
                f"{what} is not implemented by this trainer yet; use recipe: bf16 with qlora_fp8, qlora_bnb or LoRA"
            )


def check_recipe_hardware(cfg: TrainerConfig) -> None:
    """check_precision_support as a command starts, before the model is looked up or an engine
    starts, for the settings that need particular hardware (nothing is imported otherwise)."""
    if cfg.recipe == "fp8_hybrid" or cfg.qlora_fp4:
        check_precision_support(cfg, resolve_device(cfg))


def choose_dtype(device: torch.device) -> torch.dtype:
    import torch

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
