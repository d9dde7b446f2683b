"""The HF trainer's step with a micro-batch's pieces cut into padded calls by length (CPU's rule) or
by the token budget alone (the rule before, and the GPU's), in turns.

Random rollouts of varying length (--prompts prompts of --prompt-min..--prompt-max tokens, --group
completions of 3..--max-tokens each; --group 1 gives plain samples), whole prefix trees, embedded
SmolLM2-135M, LoRA r16 alpha 32 on all linear layers, the trainer's default dtype and the memory
plan's settings on this machine. Each round trains one batch once per variant (order reversed every
other round) in one process, so that a busy minute of the machine falls on all of them. Variants set
grpo.trainer.packing's CPU_PADDING_TOLERANCE / CPU_MIN_CALL_TOKENS:
- budget: 1.0 / 0 (pieces share a call while the padded call fits the micro-batch's tokens)
- grpo's CPU default: 0.05 / 256
- no floor: 0.05 / 0 (each call's fixed cost shows)

Usage: python benchmarks/padding_bench.py [--rounds 6] [--prompts 8] [--group 8] [--prompt-min 20]
    [--prompt-max 36] [--max-tokens 24]
    plain samples: --prompts 64 --group 1 --prompt-min 15 --prompt-max 25 --max-tokens 40
Writes benchmarks/results/padding_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

from e2e_bench import RESULTS, load_average, machine_info, machine_label
from group_sweep_bench import planned_config
from prefix_bench import random_rollouts

VARIANTS = {"budget": (1.0, 0), "default": (0.05, 256), "no_floor": (0.05, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-min", type=int, default=20)
    parser.add_argument("--prompt-max", type=int, default=36)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    import numpy as np
    import torch

    import grpo.trainer.packing as packing
    from grpo.models.embedded import build
    from grpo.orchestrator.batching.packer import pack_rollouts
    from grpo.trainer.hf.trainer import Trainer
    from grpo.transport.batches.batch import TrainingBatch

    torch.manual_seed(0)
    load_before = load_average()
    cfg = planned_config(str(build()), 2048, args.prompts * args.group * (args.prompt_max + args.max_tokens))
    trainer = Trainer(cfg, tempfile.mkdtemp())
    vocab = trainer.policy.causal_lm.config.vocab_size
    padded_forwards = packing.padded_forwards
    counts = {name: {"padded": 0, "tokens": 0, "calls": 0} for name in VARIANTS}
    current = ["budget"]

    def counted(*call_args: Any, **kwargs: Any) -> Any:
        forwards = padded_forwards(*call_args, **kwargs)
        count = counts[current[0]]
        count["padded"] += sum(f.input_ids.numel() for f in forwards)
        count["tokens"] += sum(f.tokens.numel() for f in forwards)
        count["calls"] += len(forwards)
        return forwards

    def use(name: str) -> None:
        current[0] = name
        packing.CPU_PADDING_TOLERANCE, packing.CPU_MIN_CALL_TOKENS = VARIANTS[name]

    def batch(step: int) -> TrainingBatch:
        rng = np.random.default_rng(step)
        prompt_lengths = rng.integers(args.prompt_min, args.prompt_max + 1, args.prompts).tolist()
        rollouts = random_rollouts(rng, prompt_lengths, args.group, (3, args.max_tokens), vocab, -3.0)
        rows, _ = pack_rollouts(rollouts, 2048, True, cfg.micro_batch_tokens)
        return TrainingBatch(step=step, rows=rows)

    use("default")
    trainer.train_step(batch(0))  # warm-up, not counted
    packing.padded_forwards = counted  # build_micro_batch looks it up in the module
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for round_index in range(args.rounds):
        step_batch = batch(round_index + 1)
        for name in names if round_index % 2 == 0 else names[::-1]:
            use(name)
            started = time.perf_counter()
            trainer.train_step(step_batch)
            seconds[name].append(time.perf_counter() - started)
            print(f"round {round_index} {name}: {seconds[name][-1]:.2f} s")
    rows_out = [
        {
            "variant": name,
            "padding_tolerance": VARIANTS[name][0],
            "min_call_tokens": VARIANTS[name][1],
            "median_step_s": statistics.median(seconds[name]),
            "step_s": seconds[name],
            "padding_fraction": 1 - counts[name]["tokens"] / counts[name]["padded"],
            "calls_per_step": counts[name]["calls"] / args.rounds,
        }
        for name in names
    ]
    result = {
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": load_average()},
        "settings": {**vars(args), "dtype": str(trainer.policy.dtype)},
        "variants": rows_out,
    }
    trainer.close()
    out = RESULTS / f"padding_{machine_label()}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows_out:
        print(
            f"{row['variant']:9} median {row['median_step_s']:.2f} s  padding {row['padding_fraction']:.1%}  "
            f"calls/step {row['calls_per_step']:.1f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
