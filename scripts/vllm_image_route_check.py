"""Check grpo's image request against a real vLLM engine, on a CPU: one short run, not a test.

vLLM's CPU engine here cannot load Qwen2-VL (docs/design.md, "Vision-language rows"), so this
builds a tiny random Idefics3 (SmolVLM's family, which it does load; the trainer does not support
it), serves it with grpo-infer, sends one prompt with one image through
`InferenceClient.generate` (the token-in route, the image as a PNG data: URL) and checks:
the prompt vLLM ran equals the HF processor's expansion of the same prompt and image, and each
completion has as many logprobs as tokens. Run it under the shared engine lock:

    flock /tmp/grpo-vllm.lock timeout 900 python scripts/vllm_image_route_check.py /tmp/tiny_idefics3
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

IMAGE_SIZE = 64
"""Side of the tiny vision tower's input (4x4 patches of 16, merged 2x2: 4 image tokens)."""
PROMPT = "<|im_start|>User:<image>How many red shapes?<end_of_utterance>\nAssistant:"


def build_tiny_idefics3(path: Path) -> Path:
    """A random Idefics3 (2-layer vision tower and text model, head_dim 64) with the SmolLM2
    tokenizer plus Idefics3's image tokens, and its processor without image splitting."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from grpo.models import embedded

    tokenizer = AutoTokenizer.from_pretrained(embedded.build())
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<fake_token_around_image>",
                "<image>",
                "<global-img>",
                "<end_of_utterance>",
            ]
        }
    )
    config = Idefics3Config(
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
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
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path


def picture() -> object:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
    ImageDraw.Draw(image).rectangle((8, 8, 30, 30), fill=(220, 30, 30))
    return image


async def check(model_path: Path, port: int) -> dict[str, object]:
    from transformers import AutoProcessor

    from grpo.config.orchestrator import ClientConfig
    from grpo.inference.client import InferenceClient
    from grpo.inference.generate_bodies import image_data_url
    from grpo.inference.types import GenerateRequest, SamplingParams

    processor = AutoProcessor.from_pretrained(model_path)
    image = picture()
    request_ids = processor.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected = processor(text=[PROMPT], images=[[image]], add_special_tokens=False)["input_ids"][0]
    client = InferenceClient(ClientConfig(base_url=[f"http://127.0.0.1:{port}/v1"], timeout=600))
    try:
        await client.wait_until_ready(600, str(model_path))
        request = GenerateRequest(
            prompt_token_ids=list(request_ids),
            params=SamplingParams(temperature=1.0, max_tokens=8, seed=0),
            n=2,
            model=str(model_path),
            image_urls=(image_data_url(image),),
        )
        completions = await client.generate(request)
    finally:
        await client.close()
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    ran = completions[0].prompt_token_ids or []
    return {
        "request_tokens": len(request_ids),
        "vllm_prompt_tokens": len(ran),
        "hf_processor_prompt_tokens": len(expected),
        "vllm_image_tokens": ran.count(image_token),
        "prompt_equals_hf_processor": ran == list(expected),
        "completions": [
            {
                "tokens": len(c.token_ids),
                "logprobs": len(c.logprobs),
                "finish": c.finish_reason,
                "first_logprobs": c.logprobs[:3],
            }
            for c in completions
        ],
    }


def main() -> int:
    model_path = build_tiny_idefics3(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny_idefics3"))
    port = int(os.environ.get("PORT", "8123"))
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "infer.yaml"
        config.write_text(
            json.dumps(
                {
                    "model": str(model_path),
                    "port": port,
                    "enable_lora": False,
                    "max_model_len": 256,
                    "dtype": "float32",
                }
            )
        )
        server = subprocess.Popen([str(Path(sys.executable).parent / "grpo-infer"), str(config)])
        try:
            result = asyncio.run(check(model_path, port))
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(json.dumps(result, indent=1))
    ok = result["prompt_equals_hf_processor"] and all(
        c["tokens"] == c["logprobs"]  # type: ignore[index]
        for c in result["completions"]  # type: ignore[attr-defined]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
