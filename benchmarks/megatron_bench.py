"""Full fine-tuning step time: the HF backend vs the Megatron backend (`backend: megatron`), same batches.

Both train every parameter of the same model on the same packed batches (trainer_bench.make_batch),
one process per variant, in the compute dtype each picks (bf16 on CPUs with AVX512-BF16/AMX), with
Adam and the same learning rate; the first step is a warm-up and not timed. Variants:
- hf_full: grpo.trainer.trainer.Trainer with lora: false (torch AdamW, gradient checkpointing off)
- megatron: grpo.trainer.megatron.trainer.MegatronTrainer at tensor/pipeline/data parallel 1
  (Megatron's DDP and DistributedOptimizer, local layer spec, the CPU compatibility layer)

Usage: python benchmarks/megatron_bench.py [--model PATH] [--rows 4] [--row-tokens 256] [--steps 3]
Writes benchmarks/results/megatron_<machine>.json (machine, versions, config, command, load average).
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

sys.path.insert(0, str(Path(__file__).parent))

from trainer_bench import make_batch

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("hf_full", "megatron")


def run_variant(
    variant: str, model: str, num_rows: int, row_tokens: int, num_steps: int
) -> dict[str, object]:
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
        gradient_accumulation_steps=1,
        logprob_chunk_size=256,
        loss={"token_mask_low": 0.0, "geo_mask_low": 0.0},
        learning_rate=1e-5,
        gradient_checkpointing=False,
    )
    trainer = build_trainer(cfg, Path(tempfile.mkdtemp()))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    batches = [make_batch(s, num_rows, row_tokens, vocab) for s in range(num_steps + 1)]
    started = time.perf_counter()
    trainer.train_step(batches[0])
    warmup_s = time.perf_counter() - started
    step_times = []
    for batch in batches[1:]:
        started = time.perf_counter()
        trainer.train_step(batch)
        step_times.append(time.perf_counter() - started)
    return {
        "step_s": sum(step_times) / len(step_times),
        "step_times_s": step_times,
        "warmup_step_s": warmup_s,
        "tokens_per_s": num_rows * row_tokens * len(step_times) / sum(step_times),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.model, args.rows, args.row_tokens, args.steps)))
        return

    from grpo.models import embedded

    model = args.model or str(embedded.build())
    results: dict[str, object] = {}
    loads = [os.getloadavg()[0]]
    for variant in VARIANTS:
        forwarded = ["--model", model, "--rows", str(args.rows), "--row-tokens", str(args.row_tokens)]
        out = subprocess.run(
            [sys.executable, __file__, "--variant", variant, *forwarded, "--steps", str(args.steps)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        loads.append(os.getloadavg()[0])
        print(variant, results[variant], flush=True)
    import megatron.core
    import torch
    import transformers

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
        "load_average_1min": loads,
        "results": results,
        "megatron_step_over_hf_step": megatron_step / hf_step,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"megatron_{machine}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"megatron / hf full step time: {megatron_step / hf_step:.2f}x  -> {path}")


if __name__ == "__main__":
    main()
