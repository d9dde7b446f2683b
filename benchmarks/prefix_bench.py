"""Trainer step time with and without shared-prefix rows and loss-token-only logits, same batch.

A GRPO batch of 8 groups x 8 completions (8-24 tokens each) after a prompt of `--prompt-tokens`
(45 ~ the short-answer chat prompt, 350 ~ the long-brief workload), embedded SmolLM2-135M, LoRA r16
on all linear layers, the trainer's default dtype, no gradient checkpointing. Layouts:
- all_logits_plain: every rollout stored whole, lm_head + log-softmax at every position (the
  trainer before loss-token-only logits)
- loss_logits_plain: every rollout stored whole, logits only at loss tokens (`shared_prefix: false`)
- loss_logits_shared: prompts stored once per prefix tree (the default)
Each layout runs in its own interpreter. Tokens/s counts every rollout whole (prompt included), so
the three rates compare the same work; `tokens_forwarded` is what the decoder actually ran.

Usage: python benchmarks/prefix_bench.py [--prompt-tokens 45 350] [--steps 2] [--threads N]
Writes benchmarks/results/prefix_<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
LAYOUTS = ("all_logits_plain", "loss_logits_plain", "loss_logits_shared")
NUM_GROUPS, GROUP_SIZE = 8, 8


def make_rollouts(seed: int, prompt_tokens: int, vocab: int) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return random_rollouts(rng, [prompt_tokens] * NUM_GROUPS, GROUP_SIZE, (8, 24), vocab, -10.0)


def random_rollouts(
    rng: Any,
    prompt_lengths: list[int],
    group_size: int,
    completion_lengths: tuple[int, int],
    vocab: int,
    logprob: float,
) -> list:
    """A group of `group_size` rollouts per prompt (random tokens; completions of a length drawn
    from `completion_lengths`, both ends included), each with the same inference `logprob` per token."""
    from grpo.orchestrator.types import Rollout

    rollouts = []
    for group, prompt_length in enumerate(prompt_lengths):
        prompt = rng.integers(0, vocab, prompt_length).tolist()
        for _ in range(group_size):
            length = int(rng.integers(completion_lengths[0], completion_lengths[1] + 1))
            rollouts.append(
                Rollout(
                    env_name="bench",
                    example_index=group,
                    prompt_ids=prompt,
                    completion_ids=rng.integers(0, vocab, length).tolist(),
                    completion_mask=[True] * length,
                    completion_logprobs=[logprob] * length,
                    temperature=1.0,
                    start_version=0,
                    end_version=0,
                    advantage=float(rng.normal()),
                )
            )
    return rollouts


def _all_position_loss(trainer):
    """The trainer's micro-batch loss with logits at every position, as it was before."""
    import torch

    from grpo.trainer.logprobs import every_token_logprobs
    from grpo.trainer.loss import grpo_loss

    def micro_batch_loss(mb, loss_scale):
        hidden = trainer.policy.hidden_states(mb)
        every = every_token_logprobs(
            hidden, trainer.policy.lm_head, mb.input_ids, mb.parent_ids, mb.temperatures, 256
        )
        return grpo_loss(
            every[mb.loss.positions],
            mb.loss.inference_logprobs,
            mb.loss.advantages,
            torch.ones_like(mb.loss.targets, dtype=torch.bool),
            mb.loss.sequence_ids,
            trainer.cfg.loss,
            loss_scale,
        )

    return micro_batch_loss


def run_layout(layout: str, model: str, prompt_tokens: int, num_steps: int) -> dict[str, object]:
    import torch

    from grpo.config.trainer import TrainerConfig
    from grpo.orchestrator.batching.packer import pack_rollouts
    from grpo.trainer.hf.trainer import Trainer
    from grpo.transport.batches.batch import TrainingBatch

    torch.manual_seed(0)
    cfg = TrainerConfig(
        model=model,
        optimizer="adamw",
        lora_rank=16,
        lora_alpha=32,
        learning_rate=1e-5,
        gradient_checkpointing=False,
        loss={"token_mask_low": 0.0, "token_mask_high": 1e9, "geo_mask_low": 0.0, "geo_mask_high": 1e9},
    )
    trainer = Trainer(cfg, tempfile.mkdtemp())
    if layout == "all_logits_plain":
        trainer._micro_batch_loss = _all_position_loss(trainer)  # type: ignore[method-assign]
    vocab = trainer.policy.causal_lm.config.vocab_size
    share = layout == "loss_logits_shared"
    batches, stats = [], None
    for step in range(num_steps + 1):
        rows, stats = pack_rollouts(make_rollouts(step, prompt_tokens, vocab), 2048, share_prefixes=share)
        batches.append(TrainingBatch(step=step, rows=rows))
    assert stats is not None
    trainer.train_step(batches[0])  # warm-up
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    for batch in batches[1:]:
        trainer.train_step(batch)
    elapsed = time.perf_counter() - started
    return {
        "step_s": elapsed / num_steps,
        "sequence_tokens_per_s": stats.num_sample_tokens * num_steps / elapsed,
        "tokens_forwarded": stats.num_tokens,
        "sequence_tokens": stats.num_sample_tokens,
        "rows": stats.num_rows,
        "peak_rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024,
        "dtype": str(trainer.policy.dtype),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[45, 350])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per layout (default: torch's)"
    )
    parser.add_argument("--tag", default="", help="suffix of the result file name (e.g. quick)")
    parser.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(run_layout(args.layout, args.model, args.prompt_tokens[0], args.steps)))
        return

    from grpo.models import embedded

    model = args.model or str(embedded.build())
    results: dict[str, dict[str, object]] = {}
    loads = [os.getloadavg()[0]]
    threads = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads)}
    for prompt_tokens in args.prompt_tokens:
        for layout in LAYOUTS:
            command = [sys.executable, __file__, "--layout", layout, "--model", model]
            command += ["--prompt-tokens", str(prompt_tokens), "--steps", str(args.steps)]
            command += [] if args.threads is None else ["--threads", str(args.threads)]
            out = subprocess.run(
                command, capture_output=True, text=True, check=True, env={**os.environ, **threads}
            )
            key = f"prompt{prompt_tokens}_{layout}"
            results[key] = json.loads(out.stdout.strip().splitlines()[-1])
            loads.append(os.getloadavg()[0])
            print(key, results[key], flush=True)
    speedups = {
        f"prompt{p}": {
            layout: results[f"prompt{p}_{layout}"]["sequence_tokens_per_s"]  # type: ignore[operator]
            / results[f"prompt{p}_all_logits_plain"]["sequence_tokens_per_s"]
            for layout in LAYOUTS
        }
        for p in args.prompt_tokens
    }
    import torch

    machine = f"cpu-{os.cpu_count()}core" if not torch.cuda.is_available() else "cuda"
    record = {
        "machine": f"{machine}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "config": {
            "groups": NUM_GROUPS,
            "group_size": GROUP_SIZE,
            "completion_tokens": "8-24",
            "prompt_tokens": args.prompt_tokens,
            "timed_steps": args.steps,
            "threads": args.threads,
        },
        "command": " ".join(["python", "benchmarks/prefix_bench.py", *sys.argv[1:]]),
        "load_average_1min": {"start": loads[0], "max": max(loads), "end": loads[-1]},
        "results": results,
        "speedup_vs_all_logits_plain": speedups,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = f"-{args.tag}" if args.tag else ""
    (RESULTS / f"prefix_{machine}{suffix}.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(speedups, indent=2))


if __name__ == "__main__":
    main()
