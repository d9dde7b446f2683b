"""Check borrowed weights against the checkpoint once at start-up.

A new vLLM release can change how it lays out fused weights (order, padding, transposition).
Training on silently mis-mapped weights would look like a broken run much later, so a few
tensors are compared with the safetensors on disk before training starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo.trainer.quantized_weights import FP8BlockWeight

NUM_CHECKED = 4


def _checkpoint_files(model_path: str | Path) -> dict[str, Path]:
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise UserError(f"no safetensors in {model_path} to verify the borrowed weights against")
    on_disk = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            on_disk.update({name: file for name in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return on_disk


def _spread(names: list[str]) -> list[str]:
    step = max(1, len(names) // NUM_CHECKED)
    checked = names[::step][:NUM_CHECKED]
    if names[-1] not in checked:
        checked.append(names[-1])
    return checked


# FP8 E4M3 rounding leaves ~2-4% relative (Frobenius) error; a mis-mapped layout gives ~140%.
FP8_MAX_RELATIVE_ERROR = 0.08


def verify_fp8_against_checkpoint(borrowed: dict[str, FP8BlockWeight], model_path: str | Path) -> list[str]:
    """Dequantize a spread of borrowed FP8 weights (HF module names) and compare with the checkpoint."""
    import torch
    from safetensors import safe_open

    from grpo.trainer.hf.dequant import dequantize_fp8_block

    on_disk = _checkpoint_files(model_path)
    names = sorted(n for n in borrowed if f"{n}.weight" in on_disk)
    if not names:
        raise ValueError(
            "none of the borrowed FP8 weights has a counterpart in the checkpoint; name mapping is wrong"
        )
    checked = _spread(names)
    for name in checked:
        with safe_open(str(on_disk[f"{name}.weight"]), framework="pt") as f:
            expected = f.get_tensor(f"{name}.weight").float()
        got = dequantize_fp8_block(borrowed[name], dtype=torch.float32).cpu()
        error = (got - expected).norm() / expected.norm() if got.shape == expected.shape else None
        if error is None or error > FP8_MAX_RELATIVE_ERROR:
            raise ValueError(
                f"borrowed FP8 weight {name} does not match the checkpoint (relative error "
                f"{'shape' if error is None else f'{error:.3f}'}); the engine's FP8 layout is not what this version "
                "of grpo expects (on CPU, is the row-major FP8 patch active?): check the supported vLLM range"
            )
    return checked


def verify_against_checkpoint(borrowed: dict[str, torch.Tensor], model_path: str | Path) -> list[str]:
    """Compare a spread of borrowed tensors with the checkpoint; returns the names checked."""
    import torch
    from safetensors import safe_open

    on_disk = _checkpoint_files(model_path)
    names = sorted(n for n in borrowed if n in on_disk)
    if not names:
        raise ValueError(
            "none of the borrowed weights has a counterpart in the checkpoint; name mapping is wrong"
        )
    checked = _spread(names)
    for name in checked:
        with safe_open(str(on_disk[name]), framework="pt") as f:
            expected = f.get_tensor(name)
        got = borrowed[name].detach().to("cpu", expected.dtype)
        if got.shape != expected.shape or not torch.equal(got, expected):
            diff = (
                (got.float() - expected.float()).abs().max().item()
                if got.shape == expected.shape
                else "shape"
            )
            raise ValueError(
                f"borrowed weight {name} does not match the checkpoint (max diff {diff}); the engine's weight "
                "layout is not what this version of grpo expects: check the supported vLLM range"
            )
    return checked
