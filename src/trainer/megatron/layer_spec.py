"""Which megatron-core layer spec builds the decoder, and the attention mask it declares.

Transformer Engine's spec on CUDA where transformer_engine imports, else megatron-core's local spec
(plain torch modules: what runs on CPU). Both are megatron-core's own GPT specs with one change:
self-attention declares `AttnMaskType.arbitrary` instead of `causal`.

Every padded call (grpo.trainer.packing.Forward) carries its pieces' mask: causal within a sample,
each token's parent chain in a shared-prefix tree. The mask type decides whether that mask is read:
- TE's DotProductAttention with `causal` builds its own causal mask and never reads the one passed
  in, so tree rows would silently attend to their sibling completions. With `arbitrary` it reads
  the [B, 1, L, L] mask (True = masked out, megatron-core's convention too); only its unfused
  backend takes an arbitrary mask (TE's backend selection turns flash and cuDNN fused attention
  off for it), which materialises [B, heads, L, L] scores like the local spec does
  (grpo.colocate.memory_plan counts them).
- The local DotProductAttention reads a mask whenever one is passed, whatever the type; declaring
  `arbitrary` keeps the spec honest and its fused softmax (off here) from assuming causality.
Packed THD sequences (cu_seqlens) would let plain rows use flash attention, but they cannot express
a prefix tree, and the orchestrator sends shared-prefix rows by default.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def use_transformer_engine(device: torch.device) -> bool:
    """TE's layer spec on CUDA when transformer_engine is installed (its modules are CUDA-only)."""
    return device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None


def gpt_layer_spec(use_te: bool, num_experts: int = 0, qk_norm: bool = False) -> Any:
    """The decoder layer's ModuleSpec (TE's or the local one) with an arbitrary attention mask;
    with `num_experts`, an MoE MLP whose experts are one SequentialMLP of plain MLPs (their weights
    map one to one onto HF's per-expert projections), and `qk_norm`: per-head q/k RMSNorm."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.enums import AttnMaskType

    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts or None, moe_grouped_gemm=False, qk_layernorm=qk_norm
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts or None,
            moe_grouped_gemm=False,
            qk_layernorm=qk_norm,
            normalization="RMSNorm",
        )
    attention = spec.submodules.self_attention
    assert "attn_mask_type" in attention.params, "megatron-core's GPT spec names its attention mask type"
    attention.params = {**attention.params, "attn_mask_type": AttnMaskType.arbitrary}
    return spec
