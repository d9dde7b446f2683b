"""Full fine-tuning step time: the HF backend vs the Megatron backend (`backend: megatron`), same batches.

Both train every parameter of the same model on the same packed batches (trainer_bench.make_batch),
in the compute dtype each picks (bf16 on CPUs with AVX512-BF16/AMX), with Adam and the same learning
rate. Each variant lives in its own process, and the two take their steps in turns (HF step 1,
Megatron step 1, HF step 2, ...), so both see the same load from whatever else runs on the machine:
on a shared 2-core CPU one variant alone measured 25-92 s per step in busy minutes and 2.8 s in a
quiet one, which a back-to-back comparison cannot tell from a difference between the backends. The
first step of each is a warm-up and not timed. Variants:
- hf_full: grpo.trainer.hf.trainer.Trainer with lora: false (fused torch AdamW, gradient checkpointing off)
- megatron: grpo.trainer.megatron.trainer.MegatronTrainer at tensor/pipeline/data parallel 1
  (Megatron's DDP and DistributedOptimizer, local layer spec, the CPU compatibility layer)

Reported per variant: wall and process CPU seconds of each step (the CPU time counts both threads,
including time spent waiting for a busy core), the load average around each round, and the ratio of
the two step times within each round.

Usage: python benchmarks/megatron_bench.py [--model PATH] [--rows 4] [--row-tokens 256] [--steps 3]
Writes benchmarks/results/megatron_<machine>.json (machine, versions, config, command, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from trainer_bench import make_batch

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("hf_full", "megatron")


def serve_variant(variant: str, model: str, num_rows: int, row_tokens: int, num_steps: int) -> None:
    """Build the trainer, print "ready", then take step i for each line "i" read from stdin, printing
    its wall and CPU seconds as one JSON line; at end of input print peak RSS and threads."""
    import torch

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.entry import build_trainer

    torch.manual_seed(0)
    cfg = TrainerConfig(
        model=model,
        backend="megatron" if variant == "megatron" else "hf",
        lora=False,
        optimizer="adamw",
        per_device_train_batch_size=num_rows,
        micro_batches_per_backward=1,
        logprob_chunk_size=256,
        loss={"token_mask_low": 0.0, "geo_mask_low": 0.0},
        learning_rate=1e-5,
        gradient_checkpointing=False,
    )
    trainer = build_trainer(cfg, Path(tempfile.mkdtemp()))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    batches = [make_batch(s, num_rows, row_tokens, vocab) for s in range(num_steps + 1)]
    print("ready", flush=True)
    for line in sys.stdin:
        cpu_started, started = time.process_time(), time.perf_counter()
        trainer.train_step(batches[int(line)])
        step_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        print(json.dumps({"step_s": step_s, "cpu_s": cpu_s}), flush=True)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_rss_mib": peak_rss_mib, "threads": torch.get_num_threads()}), flush=True)


def _read_json(process: subprocess.Popen[str]) -> dict[str, float]:
    """The variant's next JSON line (its log lines on stdout are skipped)."""
    assert process.stdout is not None
    while not (line := process.stdout.readline()).startswith("{"):
        assert line, "the variant process ended early"
    return json.loads(line)


def run_in_turns(model: str, num_rows: int, row_tokens: int, num_steps: int) -> dict[str, object]:
    """Start one process per variant, then alternate their steps; step 0 is the warm-up."""
    forwarded = ["--model", model, "--rows", str(num_rows), "--row-tokens", str(row_tokens)]
    processes = {
        variant: subprocess.Popen(
            [sys.executable, __file__, "--variant", variant, *forwarded, "--steps", str(num_steps)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        for variant in VARIANTS
    }
    for process in processes.values():
        assert process.stdout is not None
        while process.stdout.readline().strip() != "ready":
            pass
    rounds: list[dict[str, object]] = []
    for step in range(num_steps + 1):
        row: dict[str, object] = {"load_average_1min": os.getloadavg()[0]}
        for variant, process in processes.items():
            assert process.stdin is not None
            process.stdin.write(f"{step}\n")
            process.stdin.flush()
            row[variant] = _read_json(process)
        rounds.append(row)
        print(json.dumps(row), flush=True)
    results: dict[str, object] = {"rounds_after_warmup": rounds[1:], "warmup_round": rounds[0]}
    for variant, process in processes.items():
        assert process.stdin is not None
        process.stdin.close()
        timed = [r[variant] for r in rounds[1:]]
        results[variant] = {
            "step_s": statistics.mean(t["step_s"] for t in timed),  # type: ignore[index]
            "min_step_s": min(t["step_s"] for t in timed),  # type: ignore[index]
            "cpu_s": statistics.mean(t["cpu_s"] for t in timed),  # type: ignore[index]
            "tokens_per_s": num_rows * row_tokens * len(timed) / sum(t["step_s"] for t in timed),  # type: ignore[index]
            **_read_json(process),
        }
        process.wait()
    results["megatron_step_over_hf_step_per_round"] = [
        r["megatron"]["step_s"] / r["hf_full"]["step_s"]  # type: ignore[index]
        for r in rounds[1:]
    ]
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        serve_variant(args.variant, args.model, args.rows, args.row_tokens, args.steps)
        return

    from grpo.models import embedded

    model = args.model or str(embedded.build())
    loads = [os.getloadavg()[0]]
    results = run_in_turns(model, args.rows, args.row_tokens, args.steps)
    loads.append(os.getloadavg()[0])
    import megatron.core
    import torch
    import transformers

    ratios = results["megatron_step_over_hf_step_per_round"]
    hf_step = results["hf_full"]["step_s"]  # type: ignore[index]
    megatron_step = results["megatron"]["step_s"]  # type: ignore[index]
    machine = f"cpu-{os.cpu_count()}core" if not torch.cuda.is_available() else "cuda"
    record = {
        "machine": f"{machine}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "megatron-core": megatron.core.__version__,
            "grpo": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip(),
        },
        "config": {"model": model, "rows": args.rows, "row_tokens": args.row_tokens, "steps": args.steps},
        "command": " ".join(sys.argv),
        "load_average_1min_start_end": loads,
        "results": results,
        "megatron_step_over_hf_step": megatron_step / hf_step,
        "megatron_step_over_hf_step_median_round": statistics.median(ratios),  # type: ignore[arg-type]
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"megatron_{machine}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"megatron / hf full step time: {megatron_step / hf_step:.2f}x "
        f"(per round: {', '.join(f'{r:.2f}' for r in ratios)})  -> {path}"  # type: ignore[attr-defined]
    )


if __name__ == "__main__":
    main()
