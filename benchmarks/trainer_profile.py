"""Where a trainer step's time goes: grpo's trainer on a published model shape (random weights), its
tokens/s and MFU (the trainer's own `mfu` metric), and a torch-profiler split of one step.

The split files each profiled operator's own device time (CUDA kernels on a GPU, CPU time on a CPU)
under one heading, by what it is and the shapes it ran on:
- attention: the attention kernels (sdpa, flash, FlexAttention's compiled kernels);
- decoder linears: matmuls of the decoder's projections (neither side the LoRA rank nor the vocabulary);
- lora: matmuls with the LoRA rank on a side;
- logits/logprobs: matmuls and reductions with the vocabulary on a side (lm_head, log-softmax);
- optimizer: the optimizer step's kernels;
- other: norms, activations, RoPE, copies, casts;
- host gaps: the step's wall time that no operator of the device filled (Python, launches, syncs).
Recomputation is the difference between the step with every layer recomputed and without any
(`--checkpointing true` and `false`, each in its own process; a variant that runs out of memory says
so), since a recomputed forward runs the same operators as the first one.

Usage:
    python benchmarks/trainer_profile.py --shape qwen3-4b --rows 8 --row-tokens 2048   # 16k tokens a step
    python benchmarks/trainer_profile.py --model PATH --rows 2 --row-tokens 128
Writes benchmarks/results/trainer_profile_<machine>_<model>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from trainer_bench import make_batch

RESULTS = Path(__file__).parent / "results"
SHAPES = Path(__file__).resolve().parents[1] / "configs" / "gpu" / "shapes"
SHAPE_DIRS = {
    "qwen3-0.6b": SHAPES / "models--Qwen--Qwen3-0.6B/snapshots/shape-only",
    "qwen3-4b": SHAPES / "models--Qwen--Qwen3-4B/snapshots/shape-only",
}
HEADINGS = ["attention", "decoder linears", "lora", "logits/logprobs", "optimizer", "other"]
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::baddbmm"}
LORA_RANK = 16


def heading(name: str, shapes: list[list[int]], vocab: int, lora_rank: int, on_cuda: bool) -> str:
    """The split's heading of one operator, from its name and input shapes."""
    lowered = name.lower()
    dims = {d for shape in shapes for d in shape}
    if "attention" in lowered or "flash" in lowered or "flex" in lowered:
        return "attention"
    if "compiled" in lowered:
        # On CUDA the one compiled function is FlexAttention (transformers compiles it); on a CPU
        # they are grpo's fused elementwise ops (grpo.trainer.hf.cpu_fused_ops).
        return "attention" if on_cuda else "other"
    if "_foreach" in lowered or "adam" in lowered or "optimizer" in lowered:
        return "optimizer"
    if vocab in dims:
        return "logits/logprobs"
    if name in MATMULS:
        return "lora" if lora_rank in dims else "decoder linears"
    return "other"


def split(events: Any, wall_s: float, vocab: int, lora_rank: int, on_cuda: bool) -> dict[str, float]:
    """Seconds per heading over a profile's operators (key_averages grouped by input shape)."""
    seconds = dict.fromkeys(HEADINGS, 0.0)
    for event in events:
        own_us = event.self_device_time_total if on_cuda else event.self_cpu_time_total
        if own_us > 0:
            seconds[heading(event.key, event.input_shapes or [], vocab, lora_rank, on_cuda)] += own_us / 1e6
    seconds["host gaps"] = max(0.0, wall_s - sum(seconds.values()))
    return seconds


def random_model(shape: str) -> str:
    """A random-weight bf16 checkpoint of a published shape, built once under the temp folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(tempfile.gettempdir()) / f"grpo-shape-{shape}"
    if not (folder / "config.json").exists():
        config = AutoConfig.from_pretrained(SHAPE_DIRS[shape])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return str(folder)


def run_variant(model: str, checkpointing: str, rows: int, row_tokens: int, num_steps: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.trainer import Trainer

    gradient_checkpointing: str | bool = {"true": True, "false": False}.get(checkpointing, checkpointing)
    cfg = TrainerConfig(
        model=model,
        optimizer="adamw",
        micro_batch_tokens=rows * row_tokens,
        lora_rank=LORA_RANK,
        gradient_checkpointing=gradient_checkpointing,
        loss={"token_mask_low": 0.0, "geo_mask_low": 0.0},
        learning_rate=1e-5,
    )
    trainer = Trainer(cfg, tempfile.mkdtemp())
    on_cuda = trainer.policy.device.type == "cuda"
    vocab = int(trainer.policy.causal_lm.config.vocab_size)
    step = trainer.optimizer.step

    def labelled_step(*args: Any, **kwargs: Any) -> Any:
        with record_function("optimizer.step"):
            return step(*args, **kwargs)

    trainer.optimizer.step = labelled_step  # type: ignore[method-assign]
    batches = [make_batch(s, rows, row_tokens, vocab) for s in range(num_steps + 2)]

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    try:
        trainer.train_step(batches[0])  # warm-up: kernels, compilation, allocator
        sync()
        started = time.perf_counter()
        metrics = [trainer.train_step(batch) for batch in batches[1:-1]]
        sync()
    except torch.OutOfMemoryError:
        return {"checkpointing": checkpointing, "out_of_memory": True}
    step_s = (time.perf_counter() - started) / num_steps
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with profile(activities=activities, record_shapes=True) as prof:
        profiled_started = time.perf_counter()
        trainer.train_step(batches[-1])
        sync()
        profiled_s = time.perf_counter() - profiled_started
    events = prof.key_averages(group_by_input_shape=True)
    return {
        "checkpointing": checkpointing,
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "tokens_per_step": rows * row_tokens,
        "step_s": step_s,
        "tokens_per_s": rows * row_tokens / step_s,
        "mfu": sum(m.get("mfu", 0.0) for m in metrics) / len(metrics),
        "recomputed_layers": metrics[-1].get("recomputed_layers"),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_cuda else None,
        "profiled_step_s": profiled_s,
        "split_s": split(events, profiled_s, vocab, LORA_RANK, on_cuda),
    }


def markdown(record: dict[str, Any]) -> str:
    variants = record["variants"]
    lines = [f"`{record['command']}` on {record['device']}, model {record['model']}", ""]
    lines += ["| checkpointing | tokens/s | MFU | step s | " + " | ".join([*HEADINGS, "host gaps"]) + " |"]
    lines += ["|---" * (4 + len(HEADINGS) + 1) + "|"]
    for v in variants:
        if v.get("out_of_memory"):
            lines.append(f"| {v['checkpointing']} | out of memory |" + " |" * (3 + len(HEADINGS)))
            continue
        parts = " | ".join(f"{v['split_s'][h]:.3f}" for h in [*HEADINGS, "host gaps"])
        lines.append(
            f"| {v['checkpointing']} | {v['tokens_per_s']:.0f} | {v['mfu']:.3f} | {v['step_s']:.3f} | {parts} |"
        )
    if record.get("recomputation_s") is not None:
        lines += [
            "",
            f"recomputation: {record['recomputation_s']:.3f} s a step (every layer recomputed, less none)",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPE_DIRS), default=None)
    parser.add_argument("--model", default=None, help="a local model folder instead of --shape")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpointing", nargs="*", default=["auto", "true", "false"])
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if (args.shape is None) == (args.model is None):
        parser.error("give --shape or --model")
    model = args.model or random_model(args.shape)
    if args.variant:
        print(json.dumps(run_variant(model, args.variant, args.rows, args.row_tokens, args.steps)))
        return
    variants = []
    for checkpointing in args.checkpointing:
        forwarded = ["--model", model, "--rows", str(args.rows), "--row-tokens", str(args.row_tokens)]
        out = subprocess.run(
            [sys.executable, __file__, "--variant", checkpointing, *forwarded, "--steps", str(args.steps)],
            stdout=subprocess.PIPE,
            text=True,
            check=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        variants.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(variants[-1], flush=True)
    by_name = {v["checkpointing"]: v for v in variants if not v.get("out_of_memory")}
    recomputation = None
    if "true" in by_name and "false" in by_name:
        recomputation = by_name["true"]["step_s"] - by_name["false"]["step_s"]
    name = Path(model).name
    device = next((v["device"] for v in variants if "device" in v), "unknown")
    machine = "cuda" if device != "cpu" else f"cpu-{os.cpu_count()}core"
    record = {
        "command": " ".join(["python", "benchmarks/trainer_profile.py", *sys.argv[1:]]),
        "device": device,
        "model": name,
        "variants": variants,
        "recomputation_s": recomputation,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path = RESULTS / f"trainer_profile_{machine}_{name}.json"
    out_path.write_text(json.dumps(record, indent=2) + "\n")
    out_path.with_suffix(".md").write_text(markdown(record))
    print(markdown(record), end="")


if __name__ == "__main__":
    main()
