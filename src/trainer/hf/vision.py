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
Qwen2-VL's), and Idefics3 (`idefics3`, SmolVLM: 1-D positions, its images as square tiles whose
patches travel in Qwen2-VL's layout, grpo.orchestrator.images.tiles; the trainer puts them back into
tiles for the vision tower and its pixel-shuffle connector). Others fail at load by name.
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

VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "idefics3")
"""model_type of the vision-language families whose image inputs and M-RoPE the trainer reproduces
(checked against the model's own unpacked forward, tests/trainer/hf/test_vision.py)."""

VISION_TOWER_PATTERN = r".*\.(visual|vision_model|connector)\..*"
"""Modules of the vision tower and its merger (Qwen2-VL and Qwen2.5-VL name them model.visual.*,
Idefics3 model.vision_model.* and model.connector.*)."""


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
    if config.model_type == "idefics3":
        return VisionTokens(
            image_token_id=int(config.image_token_id),
            spatial_merge_size=int(config.scale_factor),
            mrope=False,
            tile_patch_size=int(config.vision_config.patch_size),
        )
    return VisionTokens(
        image_token_id=int(config.image_token_id),
        spatial_merge_size=int(config.vision_config.spatial_merge_size),
    )


def vision_modules(causal_lm: nn.Module) -> list[nn.Module]:
    """The vision tower and what maps its outputs into the language model's embedding space."""
    inner = causal_lm.model
    if hasattr(inner, "visual"):
        return [inner.visual]
    return [inner.vision_model, inner.connector]


def freeze_vision_tower(causal_lm: nn.Module) -> int:
    """Stop gradients into the vision tower (full training of the rest); returns its parameter count."""
    params = [p for module in vision_modules(causal_lm) for p in module.parameters()]
    for param in params:
        param.requires_grad_(False)
    return sum(p.numel() for p in params)


def patches_to_tiles(pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[num_tiles * rows * cols, C * p * p] flattened patches of equal tiles -> [num_tiles, C, rows * p,
    cols * p] (the inverse of grpo.orchestrator.images.tiles.tiles_to_patches)."""
    if not bool((grid_thw == grid_thw[0]).all()) or int(grid_thw[0, 0]) != 1:
        raise ValueError(f"image tiles must all have one grid (1, rows, cols), got {grid_thw.tolist()}")
    num_tiles = int(grid_thw.shape[0])
    rows, cols = int(grid_thw[0, 1]), int(grid_thw[0, 2])
    patches = pixel_values.view(num_tiles, rows, cols, -1, patch_size, patch_size)
    return patches.permute(0, 3, 1, 4, 2, 5).reshape(num_tiles, -1, rows * patch_size, cols * patch_size)


def image_embeddings(causal_lm: nn.Module, batch: MicroBatch, tokens: VisionTokens) -> torch.Tensor:
    """[num_image_tokens, H] the vision tower's (merged) outputs for the micro-batch's images, in
    placeholder order."""
    import torch

    assert batch.vision is not None
    if tokens.tile_patch_size is not None:
        tiles = patches_to_tiles(batch.vision.pixel_values, batch.vision.grid_thw, tokens.tile_patch_size)
        # Whole tiles only (image_tiles refuses padded ones): the model's default all-ones pixel mask.
        tile_features = causal_lm.model.get_image_features(tiles[None], return_dict=True).pooler_output
        return tile_features.reshape(-1, tile_features.shape[-1])  # [tiles * image_seq_len, H]
    features = causal_lm.model.get_image_features(
        batch.vision.pixel_values, batch.vision.grid_thw, return_dict=True
    ).pooler_output
    return torch.cat(list(features), dim=0)


def vision_hidden_states(
    causal_lm: nn.Module,
    batch: MicroBatch,
    tokens: VisionTokens,
    layout: AttentionLayout,
    mask_dtype: torch.dtype,
) -> torch.Tensor:
    """Final hidden states [T, H] of a micro-batch with images (padded decoder calls)."""
    import torch

    from grpo.trainer.hf.attention import decoder_attention_mask

    assert batch.vision is not None and batch.forwards is not None
    decoder = causal_lm.get_decoder()
    embeds = decoder.get_input_embeddings()(batch.input_ids)  # [T, H]
    images = image_embeddings(causal_lm, batch, tokens)
    embeds = embeds.index_copy(0, batch.vision.placeholders, images.to(embeds.dtype))
    rope = batch.vision.rope_position_ids  # [3, T], None for 1-D positions
    parts, order_parts = [], []
    for forward in batch.forwards:
        num_pieces, length = forward.input_ids.shape
        # Padding stays zero: a padding query sees only itself and its output is dropped.
        flat = embeds.new_zeros(num_pieces * length, embeds.shape[-1])
        flat = flat.index_copy(0, forward.slots, embeds[forward.tokens])
        if rope is None:
            positions = forward.position_ids  # [B, L]
        else:
            mrope = rope.new_zeros(3, num_pieces * length)
            mrope[:, forward.slots] = rope[:, forward.tokens]
            positions = mrope.view(3, num_pieces, length)
        out = decoder(
            inputs_embeds=flat.view(num_pieces, length, -1),
            position_ids=positions,
            attention_mask=decoder_attention_mask(
                layout, forward.attention_mask, forward.position_ids, mask_dtype
            ),
            use_cache=False,
        ).last_hidden_state  # [B, L, H]
        parts.append(out.reshape(-1, out.shape[-1])[forward.slots])
        order_parts.append(forward.tokens)
    order = torch.cat(order_parts)
    return torch.cat(parts)[torch.argsort(order)]
