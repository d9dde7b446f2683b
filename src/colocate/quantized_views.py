"""The engine's FP8 linear weights -> per-HF-module FP8BlockWeight views, without copying.

vLLM keeps an FP8 linear as `weight` float8_e4m3fn [out, in] plus a float32 scale:
- block-quantized (online `fp8_per_block`, or block checkpoints): `weight_scale_inv`
  [ceil(out/128), ceil(in/128)], real = fp8 * scale per 128x128 tile;
- per-tensor: `weight_scale`, one value (or one per fused part before vLLM merges them).
Some GPU kernels store the weight transposed ([in, out] view, column-major); that is undone
with a transposed view. Fused q/k/v and gate/up rows are split like dense weights
(grpo.inference.name_map); a part that starts mid-tile keeps that tile's scale via `row_offset`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.inference.name_map import FUSED_PARTS, fused_row_sizes, hf_name
from grpo.models.shape import LINEAR_MODULES, ModelShape
from grpo.trainer.quantized_weights import FP8BlockWeight
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

VLLM_FP8_BLOCK = 128
SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def is_fp8(tensor: torch.Tensor) -> bool:
    return "float8" in str(tensor.dtype)


def fp8_rows(
    weight: torch.Tensor, scale: torch.Tensor, block: int, start: int, num_rows: int
) -> FP8BlockWeight:
    """Rows [start, start + num_rows) of a block-scaled weight, as views of `weight` and `scale`."""
    first_tile = start // block
    end_tile = -(-(start + num_rows) // block)
    return FP8BlockWeight(
        weight[start : start + num_rows],
        scale[first_tile:end_tile],
        block,
        row_offset=start - first_tile * block,
    )


def _row_major(weight: torch.Tensor, num_out: int, num_in: int, name: str) -> torch.Tensor:
    """`weight` as a logical [out, in] tensor (a transposed view when the engine stores W^T)."""
    if tuple(weight.shape) == (num_out, num_in) and not (weight.stride(0) == 1 and weight.stride(1) > 1):
        return weight
    if tuple(weight.shape) == (num_in, num_out):
        return weight.t()
    raise ValueError(
        f"engine FP8 weight {name} is {tuple(weight.shape)}, expected ({num_out}, {num_in}) or its transpose; "
        "this vLLM release lays out FP8 weights differently (unsupported vLLM version?)"
    )


def _parts(weight: torch.Tensor, scale: torch.Tensor, sizes: list[int], name: str) -> list[FP8BlockWeight]:
    """One FP8BlockWeight per row part of a (possibly fused) [out, in] FP8 weight."""
    num_out, num_in = weight.shape
    if scale.numel() == 1 or (len(sizes) > 1 and scale.dim() == 1 and scale.numel() == len(sizes)):
        # Per-tensor (or per part): a single "tile" covering each part.
        per_part = scale.reshape(-1).expand(len(sizes)) if scale.numel() == 1 else scale
        block = max(num_out, num_in)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [
            FP8BlockWeight(weight[s : s + n], per_part[i].reshape(1, 1), block)
            for i, (s, n) in enumerate(zip(starts, sizes, strict=True))
        ]
    block = VLLM_FP8_BLOCK
    expected = (-(-num_out // block), -(-num_in // block))
    if tuple(scale.shape) != expected:
        raise UserError(
            f"engine FP8 scale of {name} is {tuple(scale.shape)}, expected {expected} (128x128 blocks) or one "
            "value per tensor; per-channel FP8 is not supported for borrowing, serve with fp8_per_block"
        )
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [fp8_rows(weight, scale.float(), block, s, n) for s, n in zip(starts, sizes, strict=True)]


def borrowable_fp8_linears(
    engine_tensors: dict[str, torch.Tensor], shape: ModelShape
) -> dict[str, FP8BlockWeight]:
    """HF module name (e.g. `model.layers.0.self_attn.q_proj`) -> FP8 views, for the decoder linears."""
    out: dict[str, FP8BlockWeight] = {}
    for vllm_name, weight in engine_tensors.items():
        if ".layers." not in vllm_name or not vllm_name.endswith(".weight") or not is_fp8(weight):
            continue
        prefix = vllm_name.removesuffix("weight")
        scale = next((engine_tensors[prefix + s] for s in SCALE_NAMES if prefix + s in engine_tensors), None)
        if scale is None:
            raise ValueError(f"engine FP8 weight {vllm_name} has no {' or '.join(SCALE_NAMES)} next to it")
        module_path = hf_name(vllm_name).removesuffix(".weight")
        parent, _, module = module_path.rpartition(".")
        if module in FUSED_PARTS:
            sizes, names = fused_row_sizes(module, shape), [f"{parent}.{p}" for p in FUSED_PARTS[module]]
            num_in = shape.linear_dims(FUSED_PARTS[module][0])[0]
        elif module in LINEAR_MODULES:
            num_in, num_out = shape.linear_dims(module)
            sizes, names = [num_out], [module_path]
        else:
            continue
        row_major = _row_major(weight, sum(sizes), num_in, vllm_name)
        out.update(zip(names, _parts(row_major, scale, sizes, vllm_name), strict=True))
    return out
