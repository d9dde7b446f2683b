"""Inference service speed: completion tokens/s under a fixed load, and in-place adapter reload latency.

    .venv/bin/python benchmarks/inference_bench.py [--embedded] [--prompts 64] [--tokens 64] [--reloads 10]

Starts one vLLM server (ServerThread) on the tiny random model, or with --embedded on the real
SmolLM2-135M-Instruct, and drives it through InferenceClient: every prompt is sent at once,
each completion is exactly --tokens tokens (min_tokens = max_tokens, EOS ignored). One warm-up
round runs first. Adapter reloads alternate between two PEFT adapters under one name; then the
same load runs again through the loaded adapter (rollouts are sampled that way). Results
go to benchmarks/results/inference_<machine>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from grpo.config.trainer import DEFAULT_LORA_TARGETS

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _make_adapter(model_path: Path, out_dir: Path, seed: int, rank: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(DEFAULT_LORA_TARGETS),
        init_lora_weights=False,
    )
    get_peft_model(model, config).save_pretrained(out_dir)
    return out_dir


async def _measure(
    base_url: str, prompts: list[list[int]], num_tokens: int, adapters: list[Path], num_reloads: int
) -> dict[str, float]:
    from grpo.config.orchestrator import ClientConfig
    from grpo.inference.client import InferenceClient
    from grpo.inference.types import GenerateRequest, SamplingParams

    client = InferenceClient(ClientConfig(base_url=[base_url], timeout=3600, max_retries=0))
    params = SamplingParams(temperature=1.0, max_tokens=num_tokens, min_tokens=num_tokens)

    async def one_round(model: str = "bench") -> tuple[float, int]:
        requests = [
            GenerateRequest(prompt_token_ids=p, params=params, model=model, extra={"ignore_eos": True})
            for p in prompts
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*(client.generate(r) for r in requests))
        return time.perf_counter() - start, sum(
            len(c.token_ids) for completions in results for c in completions
        )

    await one_round()  # warm-up
    seconds, num_completion_tokens = await one_round()

    reload_seconds = []
    for i in range(num_reloads):
        start = time.perf_counter()
        await client.load_lora_adapter("policy", str(adapters[i % 2]))
        reload_seconds.append(time.perf_counter() - start)
    # The same load through the LoRA adapter, as every GRPO rollout is sampled.
    await one_round("policy")  # warm-up of the LoRA kernels
    lora_seconds, lora_tokens = await one_round("policy")
    await client.close()
    return {
        "generation_seconds": seconds,
        "completion_tokens": num_completion_tokens,
        "completion_tokens_per_s": num_completion_tokens / seconds,
        "lora_completion_tokens_per_s": lora_tokens / lora_seconds,
        "adapter_reload_median_ms": 1000 * statistics.median(reload_seconds),
        "adapter_reload_max_ms": 1000 * max(reload_seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--embedded", action="store_true", help="the real SmolLM2-135M-Instruct instead of the tiny model"
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--reloads", type=int, default=10)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--machine", default=f"cpu-{os.cpu_count()}core", help="label in the results file name"
    )
    args = parser.parse_args()

    import torch
    import vllm

    from grpo.config.inference import InferenceConfig
    from grpo.inference.server import ServerThread
    from grpo.models import embedded
    from grpo.models.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="inference-bench-"))
    model_path = embedded.build() if args.embedded else build_tiny_model(work / "tiny")
    adapters = [
        _make_adapter(model_path, work / f"adapter{i}", seed=i, rank=args.lora_rank) for i in range(2)
    ]
    cfg = InferenceConfig(
        model="bench",
        port=0,
        max_model_len=args.prompt_tokens + args.tokens + 16,
        max_lora_rank=args.lora_rank,
        max_num_seqs=args.prompts,
        kv_cache_space_gb=2,
    )
    # Distinct prompts (no prefix sharing), fixed token ids from the ordinary vocabulary.
    prompts = [
        [1000 + (7 * i + 13 * j) % 20000 for j in range(args.prompt_tokens)] for i in range(args.prompts)
    ]

    server = ServerThread(cfg, str(model_path)).start()
    start = time.perf_counter()
    try:
        server.wait_ready(timeout=600)
        startup_seconds = time.perf_counter() - start
        measured = asyncio.run(_measure(server.base_url, prompts, args.tokens, adapters, args.reloads))
    finally:
        server.stop()

    result = {
        "machine": args.machine,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "vllm": vllm.__version__,
        },
        "config": {
            "model": "SmolLM2-135M-Instruct (embedded, bf16)"
            if args.embedded
            else "tiny random llama (2 layers, hidden 128)",
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens_per_prompt": args.tokens,
            "lora_rank": args.lora_rank,
            "reloads": args.reloads,
        },
        "command": "python benchmarks/inference_bench.py " + " ".join(sys.argv[1:]),
        "server_startup_seconds": startup_seconds,
        **measured,
    }
    suffix = "_embedded" if args.embedded else "_tiny"
    out = Path(__file__).parent / "results" / f"inference_{args.machine}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
