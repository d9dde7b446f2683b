"""The engine's fused mixture-of-experts weights -> the HF model's expert tensors, without copying.

vLLM's fused-MoE layer holds a layer's routed experts as two 3-D parameters (vLLM 0.32 names them
`mlp.experts.routed_experts.w13_weight`, older releases `mlp.experts.w13_weight`):
`w13_weight` [E, 2 x I, H] (each expert's gate rows, then its up rows) and `w2_weight` [E, H, I].
transformers 5 holds them the same way (`mlp.experts.gate_up_proj` [E, 2 x I, H], gate first,
and `mlp.experts.down_proj` [E, H, I]), so the engine's tensor is the trainer's parameter as it is:
no split, no transpose, no copy. Only the module path differs by family (vLLM's Mixtral keeps the
checkpoint's `block_sparse_moe`).

On CPU vLLM replaces both by a grouped-GEMM prepacked copy (its intermediate zero-padded to the
kernel's alignment), which no other code reads; grpo's worker patch keeps the tensors as loaded
under `w13_weight_dense` / `w2_weight_dense` (grpo.inference.vllm_compat.cpu_weights), and those are
borrowed. On a GPU the unquantized Triton experts compute with the loaded layout, borrowed directly
(read from vLLM 0.32's sources, not run here; the start-up check below catches a shuffled layout).

Checkpoints store experts one by one (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.{e}.w1/w3/w2.weight`), so the start-up check compares a spread of the
borrowed expert tensors, a few experts each, with those.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

BORROWABLE_MOE_FAMILIES = ("qwen3_moe", "mixtral")
"""Families whose experts co-located mode borrows (config.json `model_type`); checked end to end on
vLLM-CPU (docs/moe.md)."""

_ENGINE_EXPERTS = re.compile(
    r"^(.*\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?:routed_experts\.)?(w13_weight|w2_weight)(_dense)?$"
)
_HF_PARAM = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}

# Checkpoint names of expert e's (gate, up, down) under a layer prefix, by family layout.
_CHECKPOINT_LAYOUTS = (
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
)  # fmt: skip


def borrowable_expert_weights(engine_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF name (`model.layers.0.mlp.experts.gate_up_proj` / `.down_proj`) -> the engine's tensor,
    its dense copy where the engine keeps one beside a packed tensor."""
    out: dict[str, torch.Tensor] = {}
    for vllm_name, tensor in sorted(engine_tensors.items()):  # "w13_weight" sorts before "w13_weight_dense"
        match = _ENGINE_EXPERTS.match(vllm_name.replace(".base_layer.", "."))
        if match is None:
            continue
        layer, param, _dense = match.groups()
        out[f"{layer}.mlp.experts.{_HF_PARAM[param]}"] = tensor  # the dense copy, when there is one, wins
    return out


def _checkpoint_expert(
    on_disk: dict[str, Path], layer: str, expert: int, part: str
) -> tuple[torch.Tensor, str] | None:
    """Expert `expert`'s gate_up ([gate; up] rows) or down weight of `layer` from the checkpoint."""
    import torch
    from safetensors import safe_open

    for gate, up, down in _CHECKPOINT_LAYOUTS:
        names = [gate, up] if part == "gate_up_proj" else [down]
        full = [f"{layer}.{n.format(e=expert)}" for n in names]
        if all(n in on_disk for n in full):
            tensors = []
            for name in full:
                with safe_open(str(on_disk[name]), framework="pt") as f:
                    tensors.append(f.get_tensor(name))
            return torch.cat(tensors, dim=0), full[0]
    return None


def verify_experts_against_checkpoint(borrowed: dict[str, torch.Tensor], model_path: str | Path) -> list[str]:
    """Compare experts 0, E/2 and E-1 of a spread of the borrowed expert tensors with the
    checkpoint's per-expert weights (or its fused tensor of the same name); returns the names
    checked. UserError on any difference."""
    import torch

    from grpo.colocate.verify import _checkpoint_files, _mismatch, _spread

    on_disk = _checkpoint_files(model_path)
    names = sorted(borrowed)
    checked = _spread(names)
    for name in checked:
        engine = borrowed[name].detach().to("cpu")
        layer, _, part = name.rpartition(".mlp.experts.")
        num_experts = engine.shape[0]
        for expert in sorted({0, num_experts // 2, num_experts - 1}):
            found = _checkpoint_expert(on_disk, layer, expert, part)
            if found is None:
                raise UserError(
                    f"expert {expert} of {name} is not in the checkpoint under a known name (e.g. "
                    f"{layer}.mlp.experts.{expert}.gate_proj.weight); co-located mode cannot check the borrowed "
                    "experts of this model: run grpo-infer, grpo-orch and grpo-train as separate processes"
                )
            expected, checkpoint_name = found
            got = engine[expert]
            if got.shape != expected.shape:
                raise _mismatch(
                    name,
                    f"expert {expert} is {list(got.shape)} in the engine, {list(expected.shape)} on disk",
                )
            if not torch.equal(got, expected.to(got.dtype)):
                diff = (got.float() - expected.float()).abs().max().item()
                raise _mismatch(name, f"expert {expert} differs from {checkpoint_name} by up to {diff:.3g}")
    return checked
