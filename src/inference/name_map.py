"""vLLM parameter names -> HF parameter names, with fused weights split into views.

vLLM fuses q/k/v into `qkv_proj` ([q; k; v] rows) and gate/up into `gate_up_proj` ([gate; up]
rows), and wraps a layer as `<name>.base_layer` when LoRA is enabled. The trainer's HF model
wants the separate weights; slicing rows of a row-major [out, in] weight gives views, so the
trainer's q_proj.weight is the engine's memory, not a copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.models.shape import LINEAR_MODULES, ModelShape, in_vision_tower

if TYPE_CHECKING:
    import torch

FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_row_sizes(fused: str, shape: ModelShape) -> list[int]:
    if fused == "qkv_proj":
        kv = shape.num_kv_heads * shape.head_dim
        return [shape.num_heads * shape.head_dim, kv, kv]
    if fused == "gate_up_proj":
        return [shape.intermediate_size, shape.intermediate_size]
    raise ValueError(f"not a fused module: {fused}")


def hf_name(vllm_name: str) -> str:
    """The engine's name with the LoRA wrapper removed (still fused)."""
    return vllm_name.replace(".base_layer.", ".")


def split_to_hf(vllm_name: str, tensor: torch.Tensor, shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """[(hf_name, view)] for one engine parameter; fused weights become one view per part."""
    name = hf_name(vllm_name)
    module_path, _, attr = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module not in FUSED_PARTS:
        return [(name, tensor)]
    sizes = fused_row_sizes(module, shape)
    if tensor.shape[0] != sum(sizes):
        raise ValueError(
            f"{vllm_name} has {tensor.shape[0]} rows, expected {sum(sizes)} ({'+'.join(map(str, sizes))}); "
            "the engine's layout differs from this model config (unsupported vLLM release?)"
        )
    views = tensor.split(sizes, dim=0)
    return [(f"{parent}.{part}.{attr}", view) for part, view in zip(FUSED_PARTS[module], views, strict=True)]


def borrowable_linear_weights(
    engine_tensors: dict[str, torch.Tensor], shape: ModelShape
) -> dict[str, torch.Tensor]:
    """HF name -> view, for the decoder layers' linear weights (what co-location shares).

    Norms, embeddings and lm_head stay out: they are small, and vLLM may pad the vocabulary. So does
    a vision-language model's vision tower (its layers are laid out differently; the trainer loads
    its own copy, counted in the memory plan).
    """
    out: dict[str, torch.Tensor] = {}
    for vllm_name, tensor in engine_tensors.items():
        if ".layers." not in vllm_name or not vllm_name.endswith(".weight") or "norm" in vllm_name:
            continue
        if in_vision_tower(vllm_name):
            continue
        for name, view in split_to_hf(vllm_name, tensor, shape):
            if name.rsplit(".", 2)[-2] in LINEAR_MODULES:
                out[name] = view
    return out
