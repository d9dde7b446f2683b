"""Check borrowed weights against the checkpoint once at start-up.

A new vLLM release can change how it lays out fused weights (order, padding, transposition).
Training on silently mis-mapped weights would look like a broken run much later, so a few
tensors are compared with the safetensors on disk before training starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NUM_CHECKED = 4


def verify_against_checkpoint(borrowed: dict[str, torch.Tensor], model_path: str | Path) -> list[str]:
    """Compare a spread of borrowed tensors with the checkpoint; returns the names checked."""
    import torch
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors in {model_path} to verify the borrowed weights against")
    on_disk = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            on_disk.update({name: file for name in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    names = sorted(n for n in borrowed if n in on_disk)
    if not names:
        raise ValueError(
            "none of the borrowed weights has a counterpart in the checkpoint; name mapping is wrong"
        )
    step = max(1, len(names) // NUM_CHECKED)
    checked = names[::step][:NUM_CHECKED]
    if names[-1] not in checked:
        checked.append(names[-1])
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
