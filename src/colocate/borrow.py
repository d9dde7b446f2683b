"""Borrow the engine's base linear weights for the trainer, without copying them.

After vLLM has loaded the model, every worker exports a record per parameter (shared-memory
filename on CPU, CUDA IPC handle on GPU). This process rebuilds tensors over that memory, splits
vLLM's fused weights into HF-named views, checks a few against the checkpoint, and hands them to
the trainer as its frozen base weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.colocate.model_shape import ModelShape
from grpo.colocate.name_map import borrowable_linear_weights
from grpo.colocate.verify import verify_against_checkpoint
from grpo.inference.weight_handles import rebuild_tensor
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger("colocate")

DENSE_DTYPES = {"torch.bfloat16", "torch.float16", "torch.float32"}


@dataclass
class BorrowedBase:
    tensors: dict[str, torch.Tensor]
    """HF name -> view over the engine's memory (decoder-layer linear weights)."""
    engine_tensors: dict[str, torch.Tensor]
    """Every rebuilt engine parameter (kept referenced: the views above depend on them)."""
    checked: list[str]
    """Names verified against the checkpoint at start-up."""

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def borrow_from_records(records: list[dict[str, Any]], model_path: str | Path) -> BorrowedBase:
    """Rebuild one worker's exported parameters and map them to HF names."""
    shape = ModelShape.from_folder(model_path)
    engine_tensors = {r["name"]: rebuild_tensor(r) for r in records}
    tensors = borrowable_linear_weights(engine_tensors, shape)
    quantized = sorted({str(t.dtype) for t in tensors.values()} - DENSE_DTYPES)
    if quantized:
        raise ValueError(
            f"the engine holds its base weights as {', '.join(quantized)}; co-located borrowing of quantized "
            "engine weights is not wired up yet (grpo.colocate.dequant has the NF4/FP8 kernels): serve the "
            "model unquantized, or use the multi-process mode with qlora_bnb in the trainer"
        )
    expected = 7 * shape.num_layers
    if len(tensors) != expected:
        raise ValueError(
            f"borrowed {len(tensors)} linear weights from the engine, expected {expected} "
            f"({shape.num_layers} layers x 7); the engine dropped or renamed weights (on CPU, is the dense-weight "
            "patch active?)"
        )
    checked = verify_against_checkpoint(tensors, model_path)
    borrowed = BorrowedBase(tensors, engine_tensors, checked)
    log.info(
        "borrowed %d base weights (%.1f MiB) from the engine without copying; checked %d against the checkpoint",
        len(tensors),
        borrowed.num_bytes / 2**20,
        len(checked),
    )
    return borrowed
