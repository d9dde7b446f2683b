"""Check borrowed weights against the checkpoint once at start-up.

A new vLLM release can change how it lays out fused weights (order, padding, transposition), and
vLLM's kernels may replace, repack or empty a layer's `weight` after loading
(`process_weights_after_loading`; docs/colocate.md, "What vLLM does to the weights it lends").
Training on such a handle would look like a broken run much later, so a spread of borrowed
tensors (the first, the last and a few between) is compared whole with the safetensors on disk
before training starts, and any difference stops the run in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

    from grpo.trainer.quantized_weights import FP8BlockWeight

NUM_CHECKED = 4

_FIX = (
    "vLLM replaced or repacked the weight after loading, or laid it out differently, so the trainer would train "
    "on another base; run co-located on a vLLM in the tested range (>=0.32,<0.33) with quantization null or "
    "fp8_per_block, or use the multi-process mode (the trainer loads its own base)"
)


def _mismatch(name: str, difference: str) -> UserError:
    return UserError(f"borrowed weight {name} is not the checkpoint's ({difference}): {_FIX}")


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
        if got.shape != expected.shape:
            raise _mismatch(name, f"dequantized shape {list(got.shape)}, checkpoint {list(expected.shape)}")
        error = float((got - expected).norm() / expected.norm())
        if not error <= FP8_MAX_RELATIVE_ERROR:  # NaN included
            raise _mismatch(
                name,
                f"dequantized FP8 differs by {error:.3f} relative, rounding gives at most {FP8_MAX_RELATIVE_ERROR}",
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
        engine = borrowed[name].detach()
        if engine.shape != expected.shape:
            raise _mismatch(name, f"engine shape {list(engine.shape)}, checkpoint {list(expected.shape)}")
        # vLLM casts the checkpoint to its dtype while loading: the engine must hold exactly that.
        expected = expected.to(engine.dtype)
        got = engine.to("cpu")
        if not torch.equal(got, expected):
            rows = (got != expected).reshape(expected.shape[0], -1).any(dim=1).nonzero().flatten()
            diff = (got.float() - expected.float()).abs().max().item()
            raise _mismatch(
                name,
                f"{rows.numel()} of {expected.shape[0]} rows differ, the first at row {int(rows[0])}, by up to {diff:.3g}",
            )
    return checked
