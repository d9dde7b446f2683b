"""Inference service speed: completion tokens/s under a fixed load, and in-place adapter reload latency,
with the policy served through vLLM's LoRA path and as merged weights (inference lora_serving).

    .venv/bin/python benchmarks/inference_bench.py [--embedded] [--prompts 64] [--tokens 64] [--reloads 10]

Starts a vLLM server (ServerThread) on the tiny random model, or with --embedded on the real
SmolLM2-135M-Instruct, and drives it through InferenceClient: every prompt is sent at once,
each completion is exactly --tokens tokens (min_tokens = max_tokens, EOS ignored). A short warm-up
round (4 tokens) runs first. Adapter reloads alternate between two PEFT adapters under one name; then the
same load runs again through the loaded adapter (rollouts are sampled that way). A second server
(lora_serving: merged, no vLLM LoRA) then takes the same adapters by merging them and runs the
same load again under the adapter's name. Completions are seeded per prompt: the logprobs
both servers gave the tokens they sampled alike give the max abs difference adapter vs merged, and
an HF model with the PEFT adapter (the trainer's view, in the engine's bf16) scores each server's
completions for its mismatch KL (k3). (Not vLLM prompt logprobs: batched prompt logprobs through
a LoRA adapter crash vLLM 0.32's CPU engine, punica add_lora_logits.) Results go to benchmarks/results/inference_<machine>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
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
    base_url: str,
    prompts: list[list[int]],
    num_tokens: int,
    adapters: list[Path],
    num_reloads: int,
    base_rounds: bool = True,
) -> tuple[dict[str, float], list[list[int]], list[list[float]]]:
    """Speeds on one server; also the policy round's completions (token ids, engine logprobs).

    Completions are seeded per prompt, so two servers serving the same policy sample the same
    tokens until their logprobs differ enough to flip a draw."""
    from grpo.config.orchestrator import ClientConfig
    from grpo.inference.client import InferenceClient
    from grpo.inference.types import Completion, GenerateRequest, SamplingParams

    client = InferenceClient(ClientConfig(base_url=[base_url], timeout=3600, max_retries=0))

    async def one_round(model: str = "bench", num: int = num_tokens) -> tuple[float, list[Completion]]:
        params = SamplingParams(temperature=1.0, max_tokens=num, min_tokens=num)
        requests = [
            GenerateRequest(
                prompt_token_ids=p,
                params=dataclasses.replace(params, seed=i),
                model=model,
                cache_salt=f"round-{time.perf_counter()}",  # no prefix reuse between rounds
                extra={"ignore_eos": True},
            )
            for i, p in enumerate(prompts)
        ]
        start = time.perf_counter()
        results = await asyncio.gather(*(client.generate(r) for r in requests))
        return time.perf_counter() - start, [completions[0] for completions in results]

    measured: dict[str, float] = {}
    if base_rounds:
        await one_round(num=4)  # warm-up
        seconds, completions = await one_round()
        num_completion_tokens = sum(len(c.token_ids) for c in completions)
        measured |= {
            "generation_seconds": seconds,
            "completion_tokens": num_completion_tokens,
            "completion_tokens_per_s": num_completion_tokens / seconds,
        }

    reload_seconds = []
    for i in range(num_reloads):
        start = time.perf_counter()
        await client.load_lora_adapter("policy", str(adapters[i % 2]))
        reload_seconds.append(time.perf_counter() - start)
    # The same load through the policy (adapter path, or merged weights), as every GRPO rollout is sampled.
    await one_round("policy", num=4)  # warm-up of the LoRA kernels
    lora_seconds, completions = await one_round("policy")
    await client.close()
    measured |= {
        "lora_completion_tokens_per_s": sum(len(c.token_ids) for c in completions) / lora_seconds,
        "adapter_reload_median_ms": 1000 * statistics.median(reload_seconds),
        "adapter_reload_max_ms": 1000 * max(reload_seconds),
    }
    return measured, [c.token_ids for c in completions], [c.logprobs for c in completions]


def _trainer_logprobs(
    model_path: Path, adapter: Path, prompts: list[list[int]], completions: list[list[int]], dtype: str
) -> list[list[float]]:
    """Per-token logprobs of each completion under HF + the PEFT adapter (unmerged), as the trainer
    computes them."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits.float()[0, len(prompt) - 1 : -1]
            out.append(
                torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None])[:, 0].tolist()
            )
    return out


def _mismatch(engine: list[list[float]], trainer: list[list[float]]) -> dict[str, float]:
    """k3 estimate of KL(engine || trainer) over the engine's sampled tokens, and the mean abs difference."""
    import math

    diffs = [t - e for es, ts in zip(engine, trainer, strict=True) for e, t in zip(es, ts, strict=True)]
    return {
        "mismatch_kl_k3": statistics.fmean(math.exp(d) - d - 1 for d in diffs),
        "mean_abs_logprob_diff": statistics.fmean(abs(d) for d in diffs),
    }


def _common_prefix_diff(
    a_ids: list[list[int]], a_lps: list[list[float]], b_ids: list[list[int]], b_lps: list[list[float]]
) -> dict[str, float]:
    """Two engines' seeded completions: logprob differences on the tokens both sampled alike."""
    diffs, same, total = [], 0, 0
    for ai, al, bi, bl in zip(a_ids, a_lps, b_ids, b_lps, strict=True):
        total += len(ai)
        for x, lx, y, ly in zip(ai, al, bi, bl, strict=False):
            if x != y:
                break
            same += 1
            diffs.append(abs(lx - ly))
    return {
        "max_abs_logprob_diff": max(diffs),
        "mean_abs_logprob_diff": statistics.fmean(diffs),
        "fraction_of_tokens_alike": same / total,
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
        lora_serving="adapter",
        weight_dirs=[str(work)],
    )
    # Distinct prompts (no prefix sharing), fixed token ids from the ordinary vocabulary.
    prompts = [
        [1000 + (7 * i + 13 * j) % 20000 for j in range(args.prompt_tokens)] for i in range(args.prompts)
    ]

    def serve(
        cfg: InferenceConfig, **kwargs: object
    ) -> tuple[float, dict[str, float], list[list[int]], list[list[float]]]:
        server = ServerThread(cfg, str(model_path)).start()
        start = time.perf_counter()
        try:
            server.wait_ready(timeout=600)
            startup = time.perf_counter() - start
            return startup, *asyncio.run(
                _measure(server.base_url, prompts, args.tokens, adapters, args.reloads, **kwargs)  # type: ignore[arg-type]
            )
        finally:
            server.stop()

    startup_seconds, measured, adapter_ids, adapter_lps = serve(cfg)
    _, merged, merged_ids, merged_lps = serve(
        cfg.model_copy(update={"lora_serving": "merged"}), base_rounds=False
    )
    # The last reload left adapters[(reloads - 1) % 2] loaded on both servers.
    policy = adapters[(args.reloads - 1) % 2]
    # Both models are stored in bf16, so the engine (dtype auto) and a co-located trainer compute in bf16.
    adapter_trainer = _trainer_logprobs(model_path, policy, prompts, adapter_ids, "bfloat16")
    merged_trainer = _trainer_logprobs(model_path, policy, prompts, merged_ids, "bfloat16")
    alike = _common_prefix_diff(adapter_ids, adapter_lps, merged_ids, merged_lps)
    measured |= {
        "merged_completion_tokens_per_s": merged["lora_completion_tokens_per_s"],
        "merge_reload_median_ms": merged["adapter_reload_median_ms"],
        "merge_reload_max_ms": merged["adapter_reload_max_ms"],
        **{f"adapter_vs_merged_{k}": v for k, v in alike.items()},
        **{f"adapter_vs_trainer_{k}": v for k, v in _mismatch(adapter_lps, adapter_trainer).items()},
        **{f"merged_vs_trainer_{k}": v for k, v in _mismatch(merged_lps, merged_trainer).items()},
    }

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
            "lora_serving": "adapter (vLLM LoRA), then merged (a second server); trainer: HF + PEFT in bf16",
        },
        "command": "python benchmarks/inference_bench.py " + " ".join(sys.argv[1:]),
        # Other work on the machine skews tokens/s: the 1-minute load average when the run ended.
        "load_average_1min_at_end": os.getloadavg()[0],
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
