"""Trainer throughput and peak memory vs a plain PEFT loop with full fp32 logits, same batch.

Each variant runs in its own interpreter; peak memory is peak RSS (ru_maxrss) and its growth over
the timed steps. No MALLOC_MMAP_THRESHOLD_ is set: a 1 MiB threshold made every activation of a
1024-token micro-batch a fresh mmap (5.6x the page faults, +35% CPU time per step); tensors big
enough to matter for peak memory (logits: tens to hundreds of MiB) are above glibc's largest dynamic
threshold (32 MiB) and are mmapped, so RSS still sees them come and go. Variants:
- trainer: grpo.trainer.Trainer (chunked logprobs, gradient checkpointing, base dtype chosen
  automatically: bf16 on CPUs with AVX512-BF16/AMX)
- trainer_no_checkpointing: the same without gradient checkpointing, i.e. the same forward and
  backward work as plain_peft (the demo configs train this way); the speed ratio uses this one
- trainer_fp32: the trainer with the base forced to fp32 (to document the bf16 choice)
- plain_peft: PEFT LoRA model, one forward per row with [tokens x vocab] fp32 logits, same loss
- logprobs_chunked / logprobs_naive: peak memory of lm_head + log-softmax forward and backward
  over `rows x row-tokens` tokens, chunked (grpo.trainer.logprobs) vs full fp32 logits

Usage: python benchmarks/trainer_bench.py [--model PATH] [--rows 4] [--row-tokens 256] [--steps 2]
Writes benchmarks/results/trainer_<machine>.json (machine, versions, config, command, load average).
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

RESULTS = Path(__file__).parent / "results"


def make_batch(step: int, num_rows: int, row_tokens: int, vocab: int):
    import numpy as np

    from grpo.transport.batches.batch import PackedRow, TrainingBatch, plain_parent_ids

    rng = np.random.default_rng(step)
    rows = []
    for _ in range(num_rows):
        # 4 samples per row, 1/4 prompt and 3/4 completion each
        sample_len = row_tokens // 4
        num_prompt = sample_len // 4
        ids = rng.integers(0, vocab, row_tokens).astype(np.int32)
        pos = np.tile(np.arange(sample_len), 4).astype(np.int32)
        mask = np.tile(np.r_[np.zeros(num_prompt, bool), np.ones(sample_len - num_prompt, bool)], 4)
        adv = np.where(mask, rng.normal(size=row_tokens), 0).astype(np.float32)
        rows.append(
            PackedRow(
                input_ids=ids,
                position_ids=pos,
                parent_ids=plain_parent_ids(pos),
                loss_mask=mask,
                advantages=adv,
                inference_logprobs=np.where(mask, -10.0, 0).astype(np.float32),
                temperatures=np.ones(row_tokens, np.float32),
            )
        )
    return TrainingBatch(step=step, rows=rows)


def _checkpointing(variant: str) -> str | bool:
    if variant.startswith("trainer_auto"):
        return "auto"
    return variant != "trainer_no_checkpointing"


def run_variant(
    variant: str, model: str, num_rows: int, row_tokens: int, num_steps: int
) -> dict[str, object]:
    import torch

    from grpo.config.trainer import TrainerConfig

    if variant.startswith("logprobs_"):
        return _logprob_memory(variant, model, num_rows * row_tokens)
    torch.manual_seed(0)
    loss = {"token_mask_low": 0.0, "geo_mask_low": 0.0}
    cfg = TrainerConfig(
        model=model,
        optimizer="adamw",
        micro_batch_tokens=num_rows * 1024,  # every row in one micro-batch (sequence_len 1024)
        micro_batches_per_backward=1,
        lora_rank=16,
        logprob_chunk_size=256,
        loss=loss,
        learning_rate=1e-5,
        gradient_checkpointing=_checkpointing(variant),
        # trainer_auto_12gib: auto with too little room for every layer's activations, so it
        # recomputes some layers and keeps the others (the plan's partial case, measured).
        activation_memory_gib=12.0 if variant == "trainer_auto_12gib" else None,
    )
    if torch.cuda.is_available():
        cfg = _co_located_budget(cfg, model, num_rows * row_tokens)
    if variant == "trainer_fp32":
        import grpo.trainer.hf.model as model_module

        model_module.choose_dtype = lambda device: torch.float32  # type: ignore[assignment]
    from grpo.trainer.hf.trainer import Trainer

    trainer = Trainer(cfg, tempfile.mkdtemp())
    vocab = trainer.policy.causal_lm.config.vocab_size
    batches = [make_batch(s, num_rows, row_tokens, vocab) for s in range(num_steps + 1)]
    if variant == "plain_peft":
        step_fn = _plain_step(trainer, cfg)
    else:
        step_fn = lambda batch: trainer.train_step(batch)  # noqa: E731
    warm_started = time.perf_counter()
    step_fn(batches[0])  # warm-up (kernels, allocator)
    warmup_s = time.perf_counter() - warm_started
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    on_cuda = trainer.policy.causal_lm.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    step_metrics = [step_fn(batch) for batch in batches[1:]]
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tokens_per_s = num_steps * num_rows * row_tokens / elapsed
    cuda = _cuda_figures(cfg, model, tokens_per_s) if on_cuda else {}
    # The trainer's own metric (LoRA-aware model FLOPs, attention and logits included, over the peak
    # of grpo.trainer.peak_flops), beside the 6 x parameters convention of `mfu`.
    own = [m["mfu"] for m in step_metrics if isinstance(m, dict) and "mfu" in m]
    recomputed = [
        m["recomputed_layers"] for m in step_metrics if isinstance(m, dict) and "recomputed_layers" in m
    ]
    return {
        **cuda,
        "recomputed_layers": recomputed[-1] if recomputed else None,
        "trainer_mfu_metric": sum(own) / len(own) if own else None,
        "tokens_per_s": tokens_per_s,
        "step_s": elapsed / num_steps,
        "warmup_step_s": warmup_s,
        "peak_rss_growth_mib": (rss_after - rss_before) / 1024,
        "peak_rss_mib": rss_after / 1024,
        "dtype": str(trainer.policy.dtype),
        "threads": torch.get_num_threads(),
    }


def _co_located_budget(cfg, model: str, num_step_tokens: int):
    """Under gradient_checkpointing auto without activation_memory_gib: `cfg` with what the
    co-located memory plan reserves for the worst case against this GPU's memory, so the trainer
    measured is the one the plan predicts (alone, auto would decide against half the GPU, and keep
    its loss tokens' probabilities there)."""
    import torch

    from grpo.models.shape import ModelShape
    from grpo.trainer.activation_plan import resolved_for_memory

    if cfg.gradient_checkpointing != "auto" or cfg.activation_memory_gib is not None:
        return cfg
    total = torch.cuda.get_device_properties(0).total_memory
    reserved, _ = resolved_for_memory(cfg, ModelShape.from_folder(model), total, num_step_tokens)
    return cfg.model_copy(update={"activation_memory_gib": reserved.activation_memory_gib})


def _cuda_figures(cfg, model: str, tokens_per_s: float) -> dict[str, object]:
    """On CUDA: MFU (6 x decoder-linear parameters FLOPs per token, the usual convention, over the
    GPU's bf16 peak) and the peak memory next to the memory plan's prediction for this trainer: its
    own micro-batch budget and, under gradient_checkpointing auto, its activation reserve
    (_co_located_budget). The plan counts what a co-located trainer adds to vLLM; this benchmark
    loads the base weights itself, so they are added to the prediction (bf16)."""
    import torch

    from grpo.colocate.memory_plan import GIB, trainer_rows
    from grpo.models.shape import ModelShape
    from grpo.trainer.peak_flops import table_peak_tflops

    shape = ModelShape.from_folder(model)
    name = torch.cuda.get_device_name()
    peak_tflops = table_peak_tflops(name)
    peak = None if peak_tflops is None else peak_tflops * 1e12
    num_params = shape.num_linear_params()
    predicted = sum(b for _, b, _ in trainer_rows(cfg, shape, on_gpu=True)) + num_params * 2
    measured = torch.cuda.max_memory_reserved()
    return {
        "device": name,
        "mfu": None if peak is None else 6 * num_params * tokens_per_s / peak,
        "peak_cuda_reserved_gib": measured / GIB,
        "planned_gib": predicted / GIB,
        "peak_within_plan": measured <= predicted,
    }


def _logprob_memory(variant: str, model: str, num_tokens: int) -> dict[str, object]:
    """Peak memory growth (RSS on a CPU, CUDA allocations on a GPU) of forward + backward through
    lm_head and log-softmax for num_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.trainer.logprobs import token_logprobs
    from grpo.utils.device import cuda_present

    # Where the trainer would run: on a GPU machine the head and its logits live in CUDA memory.
    device = torch.device("cuda" if cuda_present() else "cpu")
    causal_lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    lm_head = causal_lm.get_output_embeddings().to(device)
    lm_head.weight.requires_grad_(False)
    vocab = lm_head.weight.shape[0]
    hidden = torch.randn(
        num_tokens, lm_head.weight.shape[1], dtype=torch.bfloat16, device=device, requires_grad=True
    )
    targets = torch.randint(0, vocab, (num_tokens,), device=device)
    temperatures = torch.ones(num_tokens, device=device)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cuda_before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    started = time.perf_counter()
    if variant == "logprobs_chunked":
        lp, _ = token_logprobs(hidden, lm_head, targets, temperatures, chunk_size=256)
    else:
        logits = lm_head(hidden).float() / temperatures[:, None]
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    lp.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    growth_mib = (rss_after - rss_before) / 1024
    if device.type == "cuda":
        growth_mib = (torch.cuda.max_memory_allocated() - cuda_before) / 2**20
    return {
        "device": device.type,
        "num_tokens": num_tokens,
        "chunk_size": 256 if variant == "logprobs_chunked" else None,
        "fp32_logits_mib": num_tokens * vocab * 4 / 2**20,
        # Peak RSS growth on a CPU, peak CUDA allocation growth on a GPU.
        "peak_growth_mib": growth_mib,
        "seconds": elapsed,
    }


def _plain_step(trainer, cfg):
    """The textbook loop: full logits per row, no chunking, no gradient checkpointing."""
    import torch

    from grpo.trainer.loss import grpo_loss
    from grpo.trainer.packing import build_micro_batch, tree_attention_mask

    trainer.policy.causal_lm.gradient_checkpointing_disable()
    params = trainer.params
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate)

    def step(batch):
        optimizer.zero_grad()
        for row in batch.rows:
            mb = build_micro_batch([row], trainer.policy.device, varlen_attention=False)
            logits = (
                trainer.policy.model(
                    input_ids=mb.input_ids[None],
                    position_ids=mb.position_ids[None],
                    attention_mask=tree_attention_mask(mb.parent_ids),
                )
                .logits[0]
                .float()
            )
            log_probs = torch.log_softmax(logits[:-1] / mb.temperatures[1:, None], -1)
            lp = log_probs.gather(-1, mb.input_ids[1:, None]).squeeze(-1)
            lp = torch.cat([lp.new_zeros(1), lp])
            mask = torch.from_numpy(row.loss_mask).to(lp.device)
            loss, _ = grpo_loss(
                lp[mask],
                mb.loss.inference_logprobs,
                mb.loss.advantages,
                torch.ones_like(mb.loss.targets, dtype=torch.bool),
                mb.loss.sequence_ids,
                cfg.loss,
                batch.num_loss_tokens,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return step


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per variant (default: torch's). On a shared CPU, 1 avoids OpenMP threads "
        "spin-waiting for a descheduled peer (measured: 9x the CPU time per step at load 5 on 2 cores)",
    )
    parser.add_argument("--skip", nargs="*", default=[], help="variants to leave out (e.g. trainer_fp32)")
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        result = run_variant(args.variant, args.model, args.rows, args.row_tokens, args.steps)
        print(json.dumps(result))
        return

    from grpo.models import embedded

    model = args.model or str(embedded.build())
    results = {}
    loads = [os.getloadavg()[0]]
    variants = (
        "trainer",
        "trainer_no_checkpointing",
        "trainer_fp32",
        "plain_peft",
        "logprobs_chunked",
        "logprobs_naive",
        # The default (auto) on a GPU, and auto choosing some layers; on a CPU the default's choice
        # is measured where it matters, in the end-to-end benchmark.
        *(("trainer_auto", "trainer_auto_12gib") if _has_cuda() else ()),
    )
    threads = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads)}
    for variant in [v for v in variants if v not in args.skip]:
        forwarded = ["--model", model, "--rows", str(args.rows), "--row-tokens", str(args.row_tokens)]
        out = subprocess.run(
            [sys.executable, __file__, "--variant", variant, *forwarded, "--steps", str(args.steps)],
            stdout=subprocess.PIPE,  # the result line; the variant's log and errors reach stderr
            text=True,
            check=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **threads},
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        loads.append(os.getloadavg()[0])
        print(variant, results[variant], flush=True)
    import peft
    import torch
    import transformers

    machine = f"cpu-{os.cpu_count()}core" if not torch.cuda.is_available() else "cuda"
    record = {
        "machine": f"{machine}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "model": Path(model).name,
        "config": {
            "rows": args.rows,
            "row_tokens": args.row_tokens,
            "timed_steps": args.steps,
            "lora_rank": 16,
            "micro_batch_tokens": args.rows * 1024,
            "logprob_chunk_size": 256,
            "threads": args.threads,
            "skipped": args.skip,
        },
        "command": " ".join(["python", "benchmarks/trainer_bench.py", *sys.argv[1:]]),
        "load_average_1min": {"start": loads[0], "max": max(loads), "end": loads[-1]},
        "results": results,
    }

    def ratio(name: str, numerator: str, denominator: str, key: str, floor: float = 0.0) -> None:
        # A variant left out with --skip leaves out the ratios it is part of.
        if numerator in results and denominator in results:
            record[name] = results[numerator][key] / max(results[denominator][key], floor)

    # Same work on both sides: no activation recomputation in either.
    ratio("speedup_vs_plain_peft", "trainer_no_checkpointing", "plain_peft", "tokens_per_s")
    ratio("speedup_with_checkpointing_vs_plain_peft", "trainer", "plain_peft", "tokens_per_s")
    ratio(
        "logprob_peak_memory_ratio_naive_over_chunked",
        "logprobs_naive",
        "logprobs_chunked",
        "peak_growth_mib",
        floor=1.0,
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"trainer_{machine}.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
