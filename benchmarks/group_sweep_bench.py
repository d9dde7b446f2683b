"""Trainer step time against group size G for one shared long prompt: does the cost stay flat in G?

For one prompt of --prompt-tokens tokens (350 ~ the long-brief workload's system brief) and G
completions of --max-tokens tokens each, the trainer's work should grow with the completion tokens
only. grpo's Trainer.train_step on the packed batch (embedded SmolLM2-135M, LoRA r16 alpha 32 on all
linear layers, the trainer's default dtype, gradient_checkpointing and micro_batch_tokens as a
co-located memory plan resolves them on this machine), one layout per line:
- whole_tree: shared prefix, the group's prefix tree whole in one row of micro_batch_tokens (the
  default): the prompt is encoded once whatever G
- seq_len_trees: shared prefix in rows of --seq-len (how rows were packed before micro_batch_tokens):
  the tree is cut into pieces that each encode the prompt again
- plain: every rollout stored whole (`shared_prefix: false`; the layout TRL's trainer forwards)
With --trl (needs trl, the `bench` extra): TRL's GRPOTrainer on long-brief, one prompt x G
completions per step (benchmarks/trl_bench.py), its training time per step: the step less TRL's
generation and scoring.

Usage: python benchmarks/group_sweep_bench.py [--groups 4 8 16 32] [--prompt-tokens 350]
    [--max-tokens 24] [--steps 2] [--seq-len 512] [--trl] [--trl-precision auto] [--tag NAME]
Writes benchmarks/results/group_sweep_<machine>[_<tag>].json and .png (with matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from e2e_bench import RESULTS, ROOT, load_average, machine_info, machine_label

HERE = Path(__file__).resolve().parent
LAYOUTS = ("whole_tree", "seq_len_trees", "plain")


def group_rollouts(seed: int, group: int, prompt_tokens: int, max_tokens: int, vocab: int) -> list[Any]:
    """One prompt and `group` completions of `max_tokens` tokens (the length the sweep holds fixed)."""
    import numpy as np

    from grpo.orchestrator.types import Rollout

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, prompt_tokens).tolist()
    return [
        Rollout(
            env_name="bench",
            example_index=0,
            prompt_ids=prompt,
            completion_ids=rng.integers(0, vocab, max_tokens).tolist(),
            completion_mask=[True] * max_tokens,
            completion_logprobs=[-10.0] * max_tokens,
            temperature=1.0,
            start_version=0,
            end_version=0,
            advantage=float(rng.normal()),
        )
        for _ in range(group)
    ]


def planned_config(model: str, seq_len: int, max_step_tokens: int) -> Any:
    """The trainer config at default settings, resolved as `grpo`'s memory plan does on this machine."""
    import psutil

    from grpo.config.trainer import TrainerConfig
    from grpo.models.shape import ModelShape
    from grpo.trainer.activation_plan import resolved_for_memory

    cfg = TrainerConfig(
        model=model, sequence_len=seq_len, optimizer="adamw", lora_rank=16, lora_alpha=32, learning_rate=1e-4
    )
    memory = int(psutil.virtual_memory().available)
    return resolved_for_memory(cfg, ModelShape.from_folder(model), memory, max_step_tokens)[0]


def grpo_sweep(args: argparse.Namespace, model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Seconds per train_step for each layout and G (the mean over --steps after one warm-up)."""
    import torch

    from grpo.orchestrator.batching.packer import pack_rollouts
    from grpo.trainer.hf.trainer import Trainer
    from grpo.transport.batches.batch import TrainingBatch

    torch.manual_seed(0)
    largest = max(args.groups) * (args.prompt_tokens + args.max_tokens)
    cfg = planned_config(model, args.seq_len, largest)
    trainer = Trainer(cfg, tempfile.mkdtemp())
    vocab = trainer.policy.causal_lm.config.vocab_size
    row_tokens = {"whole_tree": cfg.micro_batch_tokens, "seq_len_trees": args.seq_len, "plain": args.seq_len}
    results: dict[str, Any] = {layout: {} for layout in LAYOUTS}
    for group in args.groups:
        for layout in LAYOUTS:
            timings, stats = [], None
            for step in range(args.steps + 1):
                rollouts = group_rollouts(step, group, args.prompt_tokens, args.max_tokens, vocab)
                rows, stats = pack_rollouts(rollouts, args.seq_len, layout != "plain", row_tokens[layout])
                started = time.perf_counter()
                metrics = trainer.train_step(TrainingBatch(step=step, rows=rows))
                if step > 0:  # step 0 warms up
                    timings.append(time.perf_counter() - started)
            assert stats is not None
            results[layout][str(group)] = {
                "step_s": sum(timings) / len(timings),
                "num_rows": stats.num_rows,
                "tokens_forwarded": stats.num_tokens,
                "sample_tokens": stats.num_sample_tokens,
                "shared_frac": 1 - stats.num_tokens / stats.num_sample_tokens,
                "recomputed_layers": metrics["recomputed_layers"],
            }
            print(f"grpo {layout:14s} G={group:3d}: {results[layout][str(group)]}", flush=True)
    settings = {
        "micro_batch_tokens": cfg.micro_batch_tokens,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "activation_memory_gib": cfg.activation_memory_gib,
        "dtype": str(trainer.policy.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
    }
    trainer.close()
    return results, settings


def trl_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's training seconds per step (step less generation and scoring) for each G."""
    results = {}
    for group in args.groups:
        tag = f"group-sweep-g{group}" + (f"-{args.tag}" if args.tag else "")
        argv = [
            *("--env", "long-brief", "--steps", str(args.steps + 1), "--prompts", "1"),
            *("--group", str(group), "--max-tokens", str(args.max_tokens), "--lr", "1e-4"),
            *("--precision", args.trl_precision, "--micro-batch", str(min(group, 8)), "--tag", tag),
        ]
        subprocess.run([sys.executable, str(HERE / "trl_bench.py"), *argv], cwd=ROOT, check=True)
        result = json.loads((RESULTS / f"trl_{machine_label()}_{tag}.json").read_text())
        train_s = result["train_step_s"][1:] or result["train_step_s"]
        results[str(group)] = {
            "train_step_s": sum(train_s) / len(train_s),
            "step_s": result.get("steady_step_s"),
            "precision": result["config"]["precision"],
        }
        print(f"TRL G={group:3d}: {results[str(group)]}", flush=True)
    return results


def plot(summary: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for layout, by_group in summary["grpo"].items():
        groups = sorted(by_group, key=int)
        ax.plot(
            [int(g) for g in groups],
            [by_group[g]["step_s"] for g in groups],
            marker="o",
            label=f"grpo {layout}",
        )
    if summary.get("trl"):
        groups = sorted(summary["trl"], key=int)
        ax.plot(
            [int(g) for g in groups],
            [summary["trl"][g]["train_step_s"] for g in groups],
            marker="s",
            label="TRL (training part of its step)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("G (completions of one prompt)")
    ax.set_ylabel("trainer seconds per step")
    cfg = summary["config"]
    ax.set_title(
        f"{cfg['prompt_tokens']}-token prompt, {cfg['max_tokens']}-token completions ({summary['label']})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--prompt-tokens", type=int, default=350)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up)")
    parser.add_argument(
        "--seq-len", type=int, default=512, help="rows of the seq_len_trees and plain layouts"
    )
    parser.add_argument("--trl", action="store_true", help="also sweep TRL (needs trl)")
    parser.add_argument("--trl-precision", default="auto", help="trl_bench.py --precision for the TRL side")
    parser.add_argument("--tag", default="", help="suffix for the result file names (e.g. quick)")
    args = parser.parse_args()
    if args.prompt_tokens + args.max_tokens > args.seq_len:
        raise ValueError("--seq-len must hold one sample: --prompt-tokens + --max-tokens")

    from grpo.models import embedded

    load_before = load_average()
    model = str(embedded.build())
    # TRL's runs first, each its own process: the grpo sweep's largest plain step fills most of
    # this machine's memory and the allocator keeps it, so a TRL process started after it is the
    # OOM killer's occasion.
    trl = trl_sweep(args) if args.trl else None
    grpo, settings = grpo_sweep(args, model)
    summary: dict[str, Any] = {
        "kind": "group_sweep",
        "label": machine_label() + (f"_{args.tag}" if args.tag else ""),
        "machine": machine_info(),
        "command": " ".join(["python", "benchmarks/group_sweep_bench.py", *sys.argv[1:]]),
        "config": {
            "model": model,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "steps": args.steps,
            "seq_len": args.seq_len,
            **settings,
        },
        "grpo": grpo,
        "trl": trl,
        "load_average": {"before": load_before, "after": load_average()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"group_sweep_{summary['label']}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"file": str(out.relative_to(ROOT))}))
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib not installed: no plot")
        return
    plot(summary, out.with_suffix(".png"))
    print(json.dumps({"plot": str(out.with_suffix(".png").relative_to(ROOT))}))


if __name__ == "__main__":
    main()
