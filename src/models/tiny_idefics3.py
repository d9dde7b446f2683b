"""A tiny random Idefics3 (SmolVLM's family) with the real SmolLM2 tokenizer, for vision-language tests.

The tokenizer is the embedded SmolLM2 one plus Idefics3's image tokens; the model has a 2-layer
vision tower (64x64 tiles of 16x16 patches, merged 2x2 by the connector's pixel shuffle, so a tile
is 4 image tokens) and a 2-layer Llama text model with head_dim 64 (vLLM's CPU attention needs it).
With image splitting (the default, as SmolVLM ships) the processor cuts an image whose longest edge
is above 64 into up to 2x2 tiles plus a 64x64 global view; without it every image is one tile.
vLLM's CPU engine serves this model (scripts/vllm_image_route_check.py) and the trainer trains it.

The chat template writes one `<image>` per image part, as SmolVLM's own does; the processor (and
vLLM) expand each into `<fake_token_around_image><row_1_col_1><image>*4...<global-img><image>*4
<fake_token_around_image>`.
"""

from __future__ import annotations

from pathlib import Path

from grpo.models.tiny import save_model_folder

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
"""Special tokens the processor and the model's config refer to, added to the SmolLM2 vocabulary."""

TILE_SIZE = 64
"""Side of one tile, the vision tower's input (4x4 patches of 16)."""

# SmolVLM-style turns ("User:<image>text<end_of_utterance>\n"), content a string or a list of parts.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build_tiny_idefics3(path: str | Path, image_splitting: bool = True, seed: int = 0) -> Path:
    """Write a random Idefics3ForConditionalGeneration (bf16 safetensors), its processor and the
    extended SmolLM2 tokenizer to `path`."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from grpo.models import embedded

    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(embedded.build())
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Idefics3Config(
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": TILE_SIZE,
            "patch_size": 16,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            # vLLM ties lm_head by the text config's flag, transformers by the top-level one: both set,
            # else vLLM would sample from an lm_head the checkpoint does not hold.
            "tie_word_embeddings": True,
        },
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=image_splitting,
        size={"longest_edge": 2 * TILE_SIZE if image_splitting else TILE_SIZE},
        max_image_size={"longest_edge": TILE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=CHAT_TEMPLATE
    )
    return save_model_folder(path, model, processor, tokenizer)
