"""The attention masks an HF decoder is handed for packed and prefix-tree rows, one per kind of layer.

A padded decoder call (grpo.trainer.packing.Forward) carries a boolean tree mask: token i may see j
iff j is i or one of its ancestors. What the decoder needs from it depends on two things:

- The attention implementation. HF's eager attention adds the mask to the scores (0 = attend, the
  dtype's minimum = masked), SDPA takes booleans, flex a BlockMask. A 4-D mask handed to the model
  is used as it is, so the trainer builds each through transformers' own mask interface
  (`ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]`), which gives each its own form.
- Sliding-window layers (Mistral, Phi-3, Qwen2 with use_sliding_window, Gemma-2/3 and gpt-oss in
  alternation). A sliding layer sees the `sliding_window` most recent tokens of the sequence,
  itself included, as when vLLM generated it unpacked; in a tree that is the last `sliding_window`
  tokens along the token's own chain of ancestors, i.e. ancestors whose position is less than
  `sliding_window` below its own. Models whose layers are of one kind get that kind's mask; models
  that mix both take a dict keyed by layer type ("full_attention", "sliding_attention").

`check_attention` runs at load: it refuses what these masks would get wrong (another kind of layer,
mixed layers in a model that takes one mask, attention soft-capping that SDPA ignores), by name.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

FULL = "full_attention"
SLIDING = "sliding_attention"

# transformers 5.x decoders that mix layer kinds pick each layer's mask with this idiom; one that
# does not would apply a single mask to every layer.
_TAKES_MASK_PER_LAYER_TYPE = "isinstance(causal_mask_mapping := attention_mask, dict)"


@dataclass(frozen=True)
class AttentionLayout:
    """Which masks a decoder's layers need."""

    layer_types: frozenset[str]
    """Kinds of layer present: FULL and/or SLIDING."""
    sliding_window: int | None
    """Tokens a sliding layer sees, itself included (None without sliding layers)."""
    implementation: str
    """transformers' `_attn_implementation` ("sdpa", "eager", "flash_attention_2", ...)."""


def attention_layout(causal_lm: nn.Module) -> AttentionLayout:
    """The decoder's layer kinds and window, as transformers' modeling code reads them from the config."""
    config = causal_lm.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Mistral, Phi-3: every layer slides when a window is set
        layer_types = [SLIDING if window is not None else FULL]
    kinds = {FULL if kind == SLIDING and window is None else kind for kind in layer_types}
    return AttentionLayout(
        layer_types=frozenset(kinds),
        sliding_window=window if SLIDING in kinds else None,
        implementation=str(causal_lm.config._attn_implementation),
    )


def check_attention(causal_lm: nn.Module) -> AttentionLayout:
    """Raise UserError for a model whose attention the trainer would compute differently from the
    model's own unpacked forward; return its layout."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = causal_lm.config.get_text_config()
    model_type = config.model_type
    layout = attention_layout(causal_lm)
    other = sorted(layout.layer_types - {FULL, SLIDING})
    if other:
        raise UserError(
            f"{model_type} has {', '.join(other)} layers, which the HF trainer cannot mask for packed rows "
            "(it supports full and sliding-window attention); train another model"
        )
    if len(layout.layer_types) > 1:
        source = inspect.getsource(type(causal_lm.get_decoder()).forward)
        if _TAKES_MASK_PER_LAYER_TYPE not in source:
            raise UserError(
                f"{model_type} mixes full and sliding-window layers but its decoder takes one attention mask for "
                "all of them, so packed rows cannot give each kind its own; train another model"
            )
    if layout.implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise UserError(
            f"{model_type} runs attention implementation {layout.implementation!r}, for which transformers "
            "builds no mask; load it with sdpa, eager or flash_attention_2"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and layout.implementation == "sdpa":
        raise UserError(
            f"{model_type} soft-caps attention scores (attn_logit_softcapping={softcap}), which sdpa attention "
            "ignores; the trainer loads such models with eager attention"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UserError(
            f"{model_type} is configured with use_bidirectional_attention, which generation never uses; "
            "set it to false in the model's config.json"
        )
    return layout


def attention_implementation_for(config: Any, requested: str, device_type: str) -> str | None:
    """The implementation to load a model with (trainer `attention`), or None for transformers'
    default (sdpa where the model supports it)."""
    text_config = config.get_text_config()
    if requested == "flex_attention" and device_type != "cuda":
        raise UserError(
            "trainer attention: flex_attention needs a CUDA GPU (torch has no FlexAttention backward on "
            f"{device_type}); set attention: auto, or sdpa/eager"
        )
    if requested != "auto":
        return requested
    # transformers renormalises flex attention's output for attention sinks with the log-sum-exp
    # rounded to the activations' 16-bit dtype, an error eager attention does not make.
    has_sinks = text_config.model_type == "gpt_oss"
    # A vision-language model's vision tower shares the implementation, and the towers'
    # FlexAttention support is unverified here.
    has_vision_tower = text_config is not config
    if device_type == "cuda" and not has_sinks and not has_vision_tower:
        return "flex_attention"
    if getattr(text_config, "attn_logit_softcapping", None) is not None:
        return "eager"
    return None


def decoder_attention_mask(
    layout: AttentionLayout,
    tree_mask: torch.Tensor,
    position_ids: torch.Tensor,
    dtype: torch.dtype,
) -> Any:
    """tree_mask [B, 1, L, L] bool (True = may attend), position_ids [B, L] -> the `attention_mask`
    argument of the decoder: one mask in the implementation's form, or a dict by layer type."""
    masks = {kind: _mask(layout, tree_mask, position_ids, dtype, kind) for kind in layout.layer_types}
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks


def _mask(
    layout: AttentionLayout,
    tree_mask: torch.Tensor,
    position_ids: torch.Tensor,
    dtype: torch.dtype,
    kind: str,
) -> Any:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    window = layout.sliding_window if kind == SLIDING else None

    def may_attend(
        batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> torch.Tensor:
        allowed = tree_mask[batch, 0, query, key]
        if window is not None:
            # Key is the query or its ancestor, so the position gap is the distance along the chain.
            allowed = allowed & (position_ids[batch, query] - position_ids[batch, key] < window)
        return allowed

    batch_size, length = position_ids.shape
    return ALL_MASK_ATTENTION_FUNCTIONS[layout.implementation](
        batch_size=batch_size,
        q_length=length,
        kv_length=length,
        mask_function=may_attend,
        allow_is_causal_skip=False,
        dtype=dtype,
        device=tree_mask.device,
    )
