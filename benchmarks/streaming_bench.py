"""Streaming micro-batches: trainer idle fraction and step time with and without streaming.

One process runs the real orchestrator (memory transport, as co-located) and the real trainer
(LoRA on a random-initialised Llama built with `grpo.models.tiny`, float32, on a thread), with a
synthetic rollout source in place of vLLM: every completion's length is drawn from a long-tail
distribution (lognormal, clipped to --max-tokens) and a group answers after its longest rollout's
length x --token-seconds (a server decoding the group's rollouts side by side). The synthetic
source sleeps instead of computing, so the trainer has the CPU to itself, as with a separate
inference GPU. The same seeds give both modes the same completion lengths.

Modes alternate (off, on, off, on, ...) for --repeats rounds, so the machine's load drifts over
both alike; the report gives each run and the on/off ratios of the means.

- idle fraction: time the trainer waited for its batch (or parts) / (that + its compute), steps
  after the first (the first waits for start-up);
- step time: wall seconds per optimizer step over the same steps.

    .venv/bin/python benchmarks/streaming_bench.py [--steps 6] [--repeats 2] [--groups-per-part 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from e2e_bench import RESULTS, load_average, machine_info, machine_label, versions

from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig
from grpo.envs import load_environment
from grpo.inference.types import Completion, GenerateRequest
from grpo.models.tiny import build_tiny_model
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.trainer.entry import run as run_trainer
from grpo.transport.batches.memory import memory_transport_pair
from grpo.utils.jsonl import read_jsonl


class LongTailServer:
    """A RolloutClient whose completions have long-tail lengths and take time in proportion."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.args = args
        self.rng = random.Random(seed)
        self.lengths: list[int] = []

    def _length(self) -> int:
        drawn = self.rng.lognormvariate(self.args.median_log, self.args.sigma)
        return max(1, min(self.args.max_tokens, round(drawn)))

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        lengths = [self._length() for _ in range(request.n)]
        self.lengths += lengths
        await asyncio.sleep(max(lengths) * self.args.token_seconds)
        out = []
        for length in lengths:
            ids = [self.rng.randrange(1000, 20000) for _ in range(length)]
            finish = "length" if length >= self.args.max_tokens else "stop"
            # About what the random-initialised policy gives a random token (-log 49152), so the
            # importance ratios stay near 1 and the loss trains instead of masking every token.
            out.append(Completion(ids, [-10.8] * length, "x" * length, finish))
        return out

    async def load_lora_adapter(self, name: str, path: str) -> None:
        return None

    def end_session(self, session_id: str) -> None:
        return None

    def pool_metrics(self) -> dict[str, int]:
        return {}


def configs(args: argparse.Namespace, run_dir: Path, model: Path, streaming: bool) -> tuple[Any, Any]:
    orch = OrchestratorConfig.model_validate(
        {
            "model": {"name": "bench", "lora_adapter": "default"},
            "env": [{"id": "reverse-text"}],
            "batch_size": args.batch_size,
            "rollouts_per_example": args.rollouts_per_example,
            "seq_len": 2048,
            "max_steps": args.steps,
            "max_async_level": args.async_level,
            "max_off_policy_steps": max(args.async_level, 1),
            "output_dir": str(run_dir),
            "seed": args.seed,
            "sampling": {"max_tokens": args.max_tokens},
            "streaming": {"groups_per_part": args.groups_per_part if streaming else None},
        }
    )
    train = TrainerConfig(
        model=str(model),
        output_dir=str(run_dir),
        max_steps=args.steps,
        max_async_level=args.async_level,
        optimizer="adamw",
        learning_rate=1e-4,
        lora_rank=8,
        lora_alpha=16,
        gradient_checkpointing=False,
        seed=args.seed,
    )
    return orch, train


def run_once(args: argparse.Namespace, model: Path, streaming: bool, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        orch_cfg, train_cfg = configs(args, run_dir, model, streaming)
        num_parts = orch_cfg.num_parts_per_step
        sender, receiver = memory_transport_pair((orch_cfg.max_async_level + 1) * num_parts)
        errors: list[BaseException] = []

        def train() -> None:
            try:
                run_trainer(train_cfg, run_dir, receiver, num_parts=num_parts)
            except BaseException as exc:
                errors.append(exc)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        server = LongTailServer(args, seed)
        tokenizer = ChatTokenizer.from_path(str(model))
        envs = [load_environment(e) for e in orch_cfg.env]
        orch = Orchestrator(orch_cfg, server, sender, run_dir, tokenizer, envs)  # type: ignore[arg-type]
        started = time.perf_counter()
        asyncio.run(orch.run())
        trainer.join()
        elapsed = time.perf_counter() - started
        if errors:
            raise errors[0]
        rows = read_jsonl(run_dir / "trainer_metrics.jsonl")
    later = rows[1:]  # the first step waits for start-up
    waited = sum(r["wait_time"] for r in later)
    computed = sum(r["step_time"] for r in later)
    return {
        "streaming": streaming,
        "num_parts": num_parts,
        "seconds": elapsed,
        "trainer_idle_frac": waited / max(waited + computed, 1e-9),
        "step_seconds": (waited + computed) / max(len(later), 1),
        "trainer_compute_s_per_step": computed / max(len(later), 1),
        "trainer_wait_s_per_step": waited / max(len(later), 1),
        "completion_len_mean": statistics.fmean(server.lengths),
        "completion_len_p50": statistics.median(server.lengths),
        "completion_len_max": max(server.lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (off, on)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rollouts-per-example", type=int, default=4)
    parser.add_argument("--groups-per-part", type=int, default=1)
    parser.add_argument("--async-level", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--median-log", type=float, default=3.4, help="log of the median length (~30)")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths")
    parser.add_argument("--token-seconds", type=float, default=0.01, help="synthetic decode s/token")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine", default=machine_label())
    args = parser.parse_args()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            Path(tmp) / "model",
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_heads=args.hidden_size // 64,
            num_kv_heads=max(1, args.hidden_size // 256),
            intermediate_size=2 * args.hidden_size,
        )
        runs = []
        for round_index in range(args.repeats):
            for streaming in (False, True):
                result = run_once(args, model, streaming, seed=args.seed + round_index)
                print(json.dumps(result), flush=True)
                runs.append(result)

    def mean(key: str, streaming: bool) -> float:
        return statistics.fmean(r[key] for r in runs if r["streaming"] == streaming)

    summary = {
        f"{key}_{mode}": mean(key, streaming)
        for key in ("trainer_idle_frac", "step_seconds", "trainer_compute_s_per_step")
        for mode, streaming in (("off", False), ("on", True))
    }
    summary["step_seconds_ratio_on_off"] = summary["step_seconds_on"] / summary["step_seconds_off"]
    summary["trainer_idle_frac_ratio_on_off"] = summary["trainer_idle_frac_on"] / max(
        summary["trainer_idle_frac_off"], 1e-9
    )
    report = {
        "machine": machine_info(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "versions": versions("torch", "transformers", "peft"),
        "rollout_source": "synthetic (LongTailServer): lognormal completion lengths, sleep per token",
        "config": {k: v for k, v in vars(args).items() if k != "machine"},
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "summary": summary,
        "runs": runs,
    }
    out = RESULTS / f"streaming_{args.machine}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
