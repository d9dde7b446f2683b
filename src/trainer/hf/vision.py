"""Vision-language models in the HF backend: which load, what is trained, and the forward with images.

A vision-language model is the HF `...ForConditionalGeneration` of a family transformers provides:
a vision tower (patches -> embeddings, merged into one per placeholder token) in front of a text
decoder. The trainer runs the vision tower on a micro-batch's pixels, puts its outputs in place of
the placeholder tokens' embeddings and runs the decoder on the packed rows as it does for text,
with the model's multi-axis rotary positions (grpo.trainer.vision_inputs). Logprobs come from the
decoder's final hidden states at completion tokens only, as for text.

LoRA adapts the language model only; the vision tower stays frozen unless `train_vision_tower`
(full training only: vLLM applies adapters to the language model).

Verified families: Qwen2-VL (`qwen2_vl`) and Qwen2.5-VL (`qwen2_5_vl`, whose M-RoPE for images is
Qwen2-VL's). Others fail at load by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo.trainer.vision_inputs import VisionTokens
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from grpo.trainer.hf.attention import AttentionLayout
    from grpo.trainer.packing import MicroBatch

VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
"""model_type of the vision-language families whose image inputs and M-RoPE the trainer reproduces
(checked against the model's own unpacked forward, tests/trainer/hf/test_vision.py)."""

VISION_TOWER_PATTERN = r".*\.visual\..*"
"""Modules of the vision tower and its merger (Qwen2-VL and Qwen2.5-VL name them model.visual.*)."""


def is_vision_language(config: Any) -> bool:
    """Whether a model config (config.json) describes a model with a vision tower."""
    return getattr(config, "vision_config", None) is not None


def vision_tokens_for(config: Any) -> VisionTokens:
    """The image token and merge size of a supported vision-language model; UserError otherwise."""
    if config.model_type not in VISION_FAMILIES:
        raise UserError(
            f"{config.model_type} is a vision-language model the trainer does not support yet "
            f"(supported: {', '.join(VISION_FAMILIES)}); train one of those or a text-only model"
        )
    return VisionTokens(
        image_token_id=int(config.image_token_id),
        spatial_merge_size=int(config.vision_config.spatial_merge_size),
    )


def vision_tower(causal_lm: nn.Module) -> nn.Module:
    tower: nn.Module = causal_lm.model.visual
    return tower


def freeze_vision_tower(causal_lm: nn.Module) -> int:
    """Stop gradients into the vision tower (full training of the rest); returns its parameter count."""
    params = list(vision_tower(causal_lm).parameters())
    for param in params:
        param.requires_grad_(False)
    return sum(p.numel() for p in params)


def image_embeddings(causal_lm: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """[num_image_tokens, H] the vision tower's (merged) outputs for the micro-batch's images, in
    placeholder order."""
    import torch

    assert batch.vision is not None
    features = causal_lm.model.get_image_features(
        batch.vision.pixel_values, batch.vision.grid_thw, return_dict=True
    ).pooler_output
    return torch.cat(list(features), dim=0)


def vision_hidden_states(
    causal_lm: nn.Module, batch: MicroBatch, layout: AttentionLayout, mask_dtype: torch.dtype
) -> torch.Tensor:
    """Final hidden states [T, H] of a micro-batch with images (padded decoder calls)."""
    import torch

    from grpo.trainer.hf.attention import decoder_attention_mask

    assert batch.vision is not None and batch.forwards is not None
    decoder = causal_lm.get_decoder()
    embeds = decoder.get_input_embeddings()(batch.input_ids)  # [T, H]
    images = image_embeddings(causal_lm, batch)
    embeds = embeds.index_copy(0, batch.vision.placeholders, images.to(embeds.dtype))
    rope = batch.vision.rope_position_ids  # [3, T]
    parts, tokens = [], []
    for forward in batch.forwards:
        num_pieces, length = forward.input_ids.shape
        # Padding stays zero: a padding query sees only itself and its output is dropped.
        flat = embeds.new_zeros(num_pieces * length, embeds.shape[-1])
        flat = flat.index_copy(0, forward.slots, embeds[forward.tokens])
        positions = rope.new_zeros(3, num_pieces * length)
        positions[:, forward.slots] = rope[:, forward.tokens]
        out = decoder(
            inputs_embeds=flat.view(num_pieces, length, -1),
            position_ids=positions.view(3, num_pieces, length),
            attention_mask=decoder_attention_mask(
                layout, forward.attention_mask, forward.position_ids, mask_dtype
            ),
            use_cache=False,
        ).last_hidden_state  # [B, L, H]
        parts.append(out.reshape(-1, out.shape[-1])[forward.slots])
        tokens.append(forward.tokens)
    order = torch.cat(tokens)
    return torch.cat(parts)[torch.argsort(order)]
