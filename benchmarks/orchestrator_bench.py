"""Orchestrator throughput with an instant fake inference server.

Measures the rollouts/s the orchestrator sustains (tokenization, scoring, advantages, packing,
batch hand-off, policy switching) and the event-loop lag p99 with ~1,000 requests in flight.
The fake server answers after `--latency` seconds; a fake trainer consumes each batch and
publishes the next policy at once.

    .venv/bin/python benchmarks/orchestrator_bench.py [--steps 5] [--batch-size 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import queue
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import load_environment
from grpo.inference.types import Completion, GenerateRequest
from grpo.models import embedded
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.transport.batches.batch import TrainingBatch
from grpo.utils.atomic import publish_dir, staging_dir


class InstantServer:
    def __init__(self, latency: float, num_tokens: int) -> None:
        self.latency = latency
        self.num_tokens = num_tokens
        self.inflight = 0
        self.max_inflight = 0

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        await asyncio.sleep(self.latency)
        self.inflight -= 1
        ids = list(range(100, 100 + self.num_tokens))
        return [Completion(ids, [-0.5] * len(ids), "olleh dlrow", "stop") for _ in range(request.n)]

    async def load_lora_adapter(self, name: str, path: str) -> None:
        return None

    def end_session(self, session_id: str) -> None:
        return None

    def pool_metrics(self) -> dict[str, int]:
        return {}


class InstantTrainer(threading.Thread):
    def __init__(self, run_dir: Path, num_steps: int) -> None:
        super().__init__(daemon=True)
        self.batches: queue.Queue[TrainingBatch] = queue.Queue(maxsize=2)
        self.run_dir = run_dir
        self.num_steps = num_steps

    def send(self, batch: TrainingBatch) -> None:
        self.batches.put(batch)

    def close(self) -> None:
        return None

    def run(self) -> None:
        for step in range(self.num_steps):
            self.batches.get()
            staged = staging_dir(self.run_dir / "broadcasts" / f"step_{step + 1}")
            publish_dir(staged, self.run_dir / "broadcasts" / f"step_{step + 1}")


async def _lag_monitor(samples: list[float], interval: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(interval)
        samples.append(loop.time() - before - interval)


async def bench(args: argparse.Namespace, run_dir: Path) -> dict[str, float]:
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "bench"},
            "batch_size": args.batch_size,
            "rollouts_per_example": args.rollouts_per_example,
            "max_steps": args.steps,
            "seq_len": 2048,
            "max_async_level": 1,
            "env": [{"id": "reverse-text"}],
            # groups of one learn only with a batch-wide baseline (the config refuses them otherwise)
            **({"advantage": {"type": "reinforce_pp"}} if args.rollouts_per_example == 1 else {}),
        }
    )
    tokenizer = ChatTokenizer.from_path(str(embedded.build()))
    envs = [load_environment(e) for e in cfg.env]
    server = InstantServer(args.latency, args.num_tokens)
    trainer = InstantTrainer(run_dir, args.steps)
    trainer.start()
    orch = Orchestrator(cfg, server, trainer, run_dir, tokenizer, envs)  # type: ignore[arg-type]
    lags: list[float] = []
    monitor = asyncio.create_task(_lag_monitor(lags))
    started = time.perf_counter()
    await orch.run()
    elapsed = time.perf_counter() - started
    monitor.cancel()
    trainer.join()
    lags.sort()
    return {
        "rollouts_per_second": args.batch_size * args.steps / elapsed,
        "seconds": elapsed,
        "max_requests_in_flight": server.max_inflight,
        "event_loop_lag_p50_ms": 1000 * statistics.median(lags),
        "event_loop_lag_p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))],
        "event_loop_lag_max_ms": 1000 * lags[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--rollouts-per-example", type=int, default=1)
    parser.add_argument("--latency", type=float, default=0.05, help="fake server seconds per request")
    parser.add_argument("--num-tokens", type=int, default=64, help="completion tokens per rollout")
    parser.add_argument("--machine", default=re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(bench(args, Path(tmp)))
    report = {
        "machine": args.machine,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("transformers", "numpy", "pydantic")},
        "config": {k: v for k, v in vars(args).items() if k != "machine"},
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "results": results,
    }
    out = Path(__file__).parent / "results" / f"orchestrator_{args.machine}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
