"""Check grpo's image request against a real vLLM engine, on a CPU: one short run, not a test.

vLLM's CPU engine here cannot load Qwen2-VL (docs/design.md, "Vision-language rows"), so this
builds a tiny random Idefics3 (SmolVLM's family, which it does load; grpo.models.tiny_idefics3),
serves it with grpo-infer, sends one prompt with one image through
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
"""Side of the tiny vision tower's input (4x4 patches of 16, merged 2x2: 4 image tokens); the model
is built without image splitting, so the picture is one tile."""
PROMPT = "<|im_start|>User:<image>How many red shapes?<end_of_utterance>\nAssistant:"


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
    from grpo.models.tiny_idefics3 import build_tiny_idefics3

    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny_idefics3")
    model_path = build_tiny_idefics3(folder, image_splitting=False)
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
