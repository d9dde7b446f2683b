"""The HF trainer's step on a short-answer batch with each of its two fast paths on or off, in turns.

A short-answer step's shape (8 prompts of --prompt-tokens, G completions of --max-tokens each, whole
prefix trees, random tokens), embedded SmolLM2-135M, LoRA r16 alpha 32 on all linear layers, the
trainer's default dtype and the memory plan's settings on this machine. Four variants, each step
timed on its own and the variants taken in turns (order reversed every other round) in one process,
so that a busy minute of the machine falls on all of them:
- peft's LoRA forward or the fused float32 one (grpo.trainer.hf.lora_fused; a no-op on a 16-bit base)
- the lm_head's logits recomputed in backward or the probabilities kept from forward
  (grpo.trainer.fused_logprobs; kept only where the activation budget has room)

Usage: python benchmarks/trainer_paths_bench.py [--rounds 3] [--prompts 8] [--group 8]
    [--prompt-tokens 28] [--max-tokens 24]
Writes benchmarks/results/trainer_paths_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

from e2e_bench import RESULTS, load_average, machine_info, machine_label
from group_sweep_bench import group_rollouts, planned_config

VARIANTS = [(False, False), (True, False), (False, True), (True, True)]
"""(fused LoRA forward, kept probabilities)"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=28)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    import torch
    from peft.tuners.lora.layer import Linear as LoraLinear

    from grpo.models.embedded import build
    from grpo.orchestrator.batching.packer import pack_rollouts
    from grpo.trainer.hf.trainer import Trainer
    from grpo.transport.batches.batch import TrainingBatch

    torch.manual_seed(0)
    load_before = load_average()
    step_tokens = args.prompts * args.group * (args.prompt_tokens + args.max_tokens)
    cfg = planned_config(str(build()), 2048, step_tokens)
    trainer = Trainer(cfg, tempfile.mkdtemp())
    vocab = trainer.policy.causal_lm.config.vocab_size
    lora_layers = [m for m in trainer.policy.model.modules() if isinstance(m, LoraLinear)]
    fused_forwards = {id(m): vars(m)["forward"] for m in lora_layers if "forward" in vars(m)}
    checkpointing = trainer.policy.checkpointing
    assert checkpointing is not None
    keeps = checkpointing.keeps_probabilities

    def use(fused: bool, keep: bool) -> None:
        for layer in lora_layers:
            if fused and id(layer) in fused_forwards:
                layer.forward = fused_forwards[id(layer)]
            elif "forward" in vars(layer):
                del layer.forward  # peft's class forward
        checkpointing.keeps_probabilities = keeps if keep else (lambda *_: False)  # type: ignore[method-assign]

    def batch(step: int) -> TrainingBatch:
        rollouts = []
        for prompt in range(args.prompts):
            group = group_rollouts(
                step * 1000 + prompt, args.group, args.prompt_tokens, args.max_tokens, vocab
            )
            for rollout in group:  # near the policy's own logprobs, so the loss keeps its gradient
                rollout.completion_logprobs = [-3.0] * args.max_tokens
            rollouts += group
        rows, _ = pack_rollouts(rollouts, 2048, True, cfg.micro_batch_tokens)
        return TrainingBatch(step=step, rows=rows)

    use(True, True)
    trainer.train_step(batch(0))  # warm-up
    seconds: dict[tuple[bool, bool], list[float]] = {v: [] for v in VARIANTS}
    step = 1
    for round_index in range(args.rounds):
        for variant in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
            use(*variant)
            step_batch = batch(step)
            step += 1
            started = time.perf_counter()
            trainer.train_step(step_batch)
            seconds[variant].append(time.perf_counter() - started)
            print(
                f"round {round_index} fused_lora={variant[0]} kept_probs={variant[1]}: {seconds[variant][-1]:.2f} s"
            )
    rows_out: list[dict[str, Any]] = [
        {
            "fused_lora": fused,
            "kept_probs": keep,
            "median_step_s": statistics.median(seconds[(fused, keep)]),
            "step_s": seconds[(fused, keep)],
        }
        for fused, keep in VARIANTS
    ]
    result = {
        "machine": machine_info(),
        "load_average": {"before": load_before, "after": load_average()},
        "settings": {**vars(args), "dtype": str(trainer.policy.dtype), "step_tokens": step_tokens},
        "variants": rows_out,
    }
    trainer.close()
    out = RESULTS / f"trainer_paths_{machine_label()}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows_out:
        print(
            f"fused_lora={row['fused_lora']!s:5} kept_probs={row['kept_probs']!s:5}: median {row['median_step_s']:.2f} s"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
