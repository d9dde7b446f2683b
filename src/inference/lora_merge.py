"""A PEFT LoRA adapter folder -> per-engine-layer low-rank updates, for merged serving.

The engine serves W_base + scaling * B @ A for each targeted layer (lora_serving: merged). vLLM
fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an HF module's update lands on a
row slice of the fused engine layer. Pure torch (no vLLM): the worker extension applies the plan.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.inference.name_map import FUSED_PARTS
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LowRankUpdate:
    """scaling * B @ A, added to rows [row_offset, row_offset + B.shape[0]) of an engine layer."""

    row_offset: int
    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out_part, r]
    scaling: float


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name by regex suffix."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def lora_scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling for `module`: alpha / r, or alpha / sqrt(r) with rslora."""
    alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"]))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_peft_adapter(
    path: str | Path,
) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(adapter_config, HF module name -> (A, B)) of a PEFT adapter folder; refuses what cannot merge."""
    from safetensors.torch import load_file

    folder = Path(path)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    unsupported = [
        reason
        for reason, present in (
            ("DoRA (use_dora)", config.get("use_dora")),
            (f"modules_to_save {config.get('modules_to_save')}", config.get("modules_to_save")),
            (f"bias {config.get('bias')!r}", config.get("bias", "none") != "none"),
        )
        if present
    ]
    if unsupported:
        raise UserError(
            f"{folder}: merged LoRA serving covers plain LoRA only, not {', '.join(unsupported)}; "
            "set lora_serving: adapter in the inference config"
        )
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_(A|B)(?:\.[^.]+)?\.weight", key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise ValueError(f"{folder}: unexpected tensor {key} in a LoRA adapter (only lora_A / lora_B)")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    incomplete = [module for module, pair in pairs.items() if set(pair) != {"A", "B"}]
    if incomplete:
        raise ValueError(f"{folder}: lora_A or lora_B missing for {incomplete[:3]}")
    return config, {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}


def merge_plan(path: str | Path, engine_layers: dict[str, list[int]]) -> dict[str, list[LowRankUpdate]]:
    """Engine layer name -> the updates adapter `path` makes to it.

    `engine_layers`: the engine's linear layers (names without the LoRA `base_layer` wrapper) ->
    their fused output sizes ([q, k, v] rows for qkv_proj, [gate, up] for gate_up_proj, [out] else).
    """
    config, modules = read_peft_adapter(path)
    plan: dict[str, list[LowRankUpdate]] = {}
    for module, (lora_a, lora_b) in sorted(modules.items()):
        parent, _, leaf = module.rpartition(".")
        layer, part = module, 0
        for fused, parts in FUSED_PARTS.items():
            if leaf in parts:
                layer, part = f"{parent}.{fused}", parts.index(leaf)
        if layer not in engine_layers:
            raise UserError(
                f"{path}: adapter module {module} has no linear layer in the engine (merged serving covers "
                "the decoder's linear layers); set lora_serving: adapter, or train other target_modules"
            )
        sizes = engine_layers[layer]
        if part >= len(sizes) or lora_b.shape[0] != sizes[part]:
            raise UserError(
                f"{path}: {module}'s lora_B has {lora_b.shape[0]} rows, but the engine's {layer} part {part} "
                f"has {sizes[part] if part < len(sizes) else 'no'} rows (another model's adapter?)"
            )
        rank = int(lora_a.shape[0])
        plan.setdefault(layer, []).append(
            LowRankUpdate(sum(sizes[:part]), lora_a, lora_b, lora_scaling(config, module, rank))
        )
    return plan


def merged_weight(base: torch.Tensor, updates: list[LowRankUpdate]) -> torch.Tensor:
    """A new tensor base + sum of updates, computed in float32, in base's dtype; `base` is not written."""
    import torch

    merged = base.detach().to(torch.float32, copy=True)
    for update in updates:
        rows = merged[update.row_offset : update.row_offset + update.lora_b.shape[0]]
        rows.addmm_(update.lora_b.to(torch.float32), update.lora_a.to(torch.float32), alpha=update.scaling)
    return merged.to(base.dtype)
