"""A tiny random Qwen2-VL or Qwen2.5-VL with the real SmolLM2 tokenizer, for vision-language tests.

The tokenizer is the embedded SmolLM2 one plus Qwen2-VL's vision special tokens (image and video
placeholders, vision start/end), so chat templates and decoding behave as in production while the
model stays small: a 2-layer vision tower (patch 14, 2x2 merge, so a 56x56 image is 4 placeholder
tokens) and a 2-layer text model with head_dim 64 (vLLM's CPU attention needs it) and M-RoPE
sections that cover it. The tokenizer's ChatML template renders image parts as
`<|vision_start|><|image_pad|><|vision_end|>` as Qwen2-VL's own does (one placeholder per image,
expanded to the image's token count by grpo.multimodal.placeholders).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from grpo.models.tiny import save_model_folder

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Special tokens the processor and the model's config refer to, added to the SmolLM2 vocabulary."""

# ChatML with content parts: a string, or a list of {"type": "text"/"image"/"video"} parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

IMAGE_MIN_PIXELS = 56 * 56
"""Smallest image the processor makes (4 merged placeholder tokens)."""
IMAGE_MAX_PIXELS = 112 * 112
"""Largest image the processor makes (16 placeholder tokens), so test sequences stay short."""


def build_tiny_vl_model(
    path: str | Path,
    family: Literal["qwen2_vl", "qwen2_5_vl"] = "qwen2_vl",
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    vision_depth: int = 2,
    vision_embed_dim: int = 64,
    seed: int = 0,
) -> Path:
    """Write a random Qwen2-VL (or Qwen2.5-VL: windowed vision attention, 2 windows per side of the
    largest image, the second block full) ForConditionalGeneration (bf16 safetensors), its image
    processor and the extended SmolLM2 tokenizer to `path`."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    from grpo.models import embedded

    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(embedded.build())
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    head_dim = hidden_size // num_heads
    # M-RoPE splits head_dim / 2 frequencies into temporal, height and width sections.
    quarter = head_dim // 8
    mrope_section = [head_dim // 2 - 2 * (3 * quarter // 2), 3 * quarter // 2, 3 * quarter // 2]
    vision: dict[str, object] = {
        "depth": vision_depth,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if family == "qwen2_vl":
        vision.update(embed_dim=vision_embed_dim, hidden_size=hidden_size, mlp_ratio=2)
    else:
        vision.update(
            hidden_size=vision_embed_dim,
            intermediate_size=2 * vision_embed_dim,
            out_hidden_size=hidden_size,
            window_size=56,
            fullatt_block_indexes=[vision_depth - 1],
        )
    config_class, model_class = {
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    }[family]
    config = config_class(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": mrope_section,
            },
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS, patch_size=14, merge_size=2
    )
    # No Qwen2VLProcessor: transformers builds one only with torchvision installed (its video
    # processor), which the CPU environment lacks; tokenizer and image processor are saved apart.
    return save_model_folder(path, model, tokenizer, image_processor)
