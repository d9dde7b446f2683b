"""Borrow the engine's base linear weights for the trainer, without copying them.

After vLLM has loaded the model, every worker exports a record per parameter (shared-memory
filename on CPU, CUDA IPC handle on GPU). This process rebuilds tensors over that memory, splits
vLLM's fused weights into HF-named views, checks a few against the checkpoint, and hands them to
the trainer as its frozen base weights. FP8 engine weights (vLLM `fp8_per_block`, or per-tensor)
travel as FP8 data + scales, and the trainer dequantizes them per matmul
(grpo.trainer.hf.quantized_base).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.colocate.expert_views import borrowable_expert_weights, verify_experts_against_checkpoint
from grpo.colocate.quantized_views import borrowable_fp8_linears, is_fp8
from grpo.colocate.verify import verify_against_checkpoint, verify_fp8_against_checkpoint
from grpo.inference.name_map import borrowable_linear_weights
from grpo.inference.weight_handles import rebuild_tensor
from grpo.models.moe import config_namespace, moe_layer_indices
from grpo.models.shape import ModelShape
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

if TYPE_CHECKING:
    import torch

    from grpo.trainer.quantized_weights import FP8BlockWeight

log = get_logger("colocate")

DENSE_DTYPES = {"torch.bfloat16", "torch.float16", "torch.float32"}


@dataclass
class BorrowedBase:
    tensors: dict[str, torch.Tensor]
    """HF name -> view over the engine's memory (dense decoder-layer linear weights, and the fused
    expert tensors of MoE layers: grpo.colocate.expert_views)."""
    quantized: dict[str, FP8BlockWeight]
    """HF module name (`...q_proj`) -> FP8 data + scales, views over the engine's memory."""
    engine_tensors: dict[str, torch.Tensor]
    """Every rebuilt engine parameter (kept referenced: the views above depend on them)."""
    checked: list[str]
    """Names verified against the checkpoint at start-up."""

    @property
    def num_bytes(self) -> int:
        tensors = [*self.tensors.values(), *(t for q in self.quantized.values() for t in (q.weight, q.scale))]
        return sum(t.numel() * t.element_size() for t in tensors)


def borrow_from_records(records: list[dict[str, Any]], model_path: str | Path) -> BorrowedBase:
    """Rebuild one worker's exported parameters and map them to HF names."""
    return borrow_engine_tensors({r["name"]: rebuild_tensor(r) for r in records}, model_path)


def borrow_engine_tensors(engine_tensors: dict[str, torch.Tensor], model_path: str | Path) -> BorrowedBase:
    """Map an engine worker's parameters (by vLLM name) to HF names, as views, and check a spread
    of them against the checkpoint."""
    shape = ModelShape.from_folder(model_path)
    dense_engine_tensors = {name: t for name, t in engine_tensors.items() if not is_fp8(t)}
    tensors = borrowable_linear_weights(dense_engine_tensors, shape)
    experts = borrowable_expert_weights(dense_engine_tensors)
    quantized = borrowable_fp8_linears(engine_tensors, shape)
    unsupported = sorted({str(t.dtype) for t in tensors.values()} - DENSE_DTYPES)
    if unsupported:
        raise UserError(
            f"the engine holds its base weights as {', '.join(unsupported)}; co-located borrowing supports dense "
            "(bf16/fp16/fp32) and FP8 engine weights: serve the model unquantized or with quantization "
            "fp8_per_block, or use the multi-process mode with qlora_bnb in the trainer"
        )
    # A dense layer lends 7 linears; an MoE layer 4 (attention) and its 2 fused expert tensors.
    num_moe_layers = len(moe_layer_indices(config_namespace(model_path)))
    if len(experts) != 2 * num_moe_layers:
        raise UserError(
            f"the engine lends {len(experts)} dense expert tensors for {num_moe_layers} MoE layers (2 each): "
            "co-located borrowing covers unquantized experts only; serve the model unquantized, or run grpo-infer, "
            "grpo-orch and grpo-train as separate processes"
        )
    expected = 7 * shape.num_layers - num_moe_layers
    if len(tensors) + len(quantized) + len(experts) != expected:
        raise ValueError(
            f"borrowed {len(tensors) + len(quantized) + len(experts)} weights from the engine, expected "
            f"{expected} ({shape.num_layers} layers x 7 linears, less 3 per each of {num_moe_layers} MoE layers "
            "whose experts are 2 fused tensors); the engine dropped or renamed weights (on CPU, is the "
            "dense-weight patch active?)"
        )
    checked = verify_against_checkpoint(tensors, model_path) if tensors else []
    if experts:
        checked += verify_experts_against_checkpoint(experts, model_path)
        tensors.update(experts)
    if quantized:
        checked += verify_fp8_against_checkpoint(quantized, model_path)
    borrowed = BorrowedBase(
        tensors=tensors, quantized=quantized, engine_tensors=engine_tensors, checked=checked
    )
    log.info(
        "borrowed %d base weights (%d FP8) (%.1f MiB) from the engine without copying; checked %d against the "
        "checkpoint",
        len(tensors) + len(quantized),
        len(quantized),
        borrowed.num_bytes / 2**20,
        len(checked),
    )
    return borrowed
