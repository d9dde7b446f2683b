"""What partial rollouts (orch partial_rollouts) recover on a long-tail workload, with partial rollouts
off and on, side by side in one run.

The real orchestrator (launching, the policy watcher, the update gate, resuming, staleness rules,
packing) drives a simulated server that samples one token per `--token-seconds` for every sequence
(decode-bound, no prefill cost) with completion lengths of a long tail: most short, some near
max_tokens. A simulated trainer takes `--train-seconds` per batch and publishes the next policy,
max_async_level 1. Without partial rollouts a request runs to its end on the policy it started
from (vLLM finishes it on the old policy): the tokens it samples after a newer policy reached the
server are "finished stale". With them, the request stops at the update and resumes under the new
policy with its tokens kept; the kept tokens are what an abort-and-restart would have discarded.

Counted over the loss tokens the trainer receives (each token's policy rides in its logprob):
trained tokens, stale tokens, tokens kept across an update, the mean policy lag of a trained
token (batch step minus the policy that sampled it); and tokens sampled but never trained (rollouts
dropped as too stale, or still in flight at the end).

    .venv/bin/python benchmarks/partial_bench.py [--steps 8] [--token-seconds 0.002]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import platform
import queue
import re
import socket
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import SingleTurnEnv
from grpo.inference.types import ABORTED, Completion, GenerateRequest
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.transport.batches.batch import TrainingBatch
from grpo.utils.atomic import publish_dir, staging_dir
from grpo.utils.jsonl import read_jsonl

SAMPLED = 60_000
"""Sampled token ids are SAMPLED + the choice's target length (above any prompt token), so a resumed
request (prompt + kept tokens) tells the server how long its choice runs and how much it kept."""
STALE_OFFSET = 0.5
"""Added to a token's encoded logprob when its request's policy was older than the server's."""


def encode_logprob(version: int, stale: bool) -> float:
    return -(1.0 + version + (STALE_OFFSET if stale else 0.0))


def decode_logprobs(logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(policy version, stale) of each token from encode_logprob's value."""
    magnitude = -logprobs - 1.0
    stale = (magnitude % 1.0) > 0.25
    return np.floor(magnitude).astype(np.int64), stale


class CharTokenizer:
    """One token per character; enough of a HF tokenizer for ChatTokenizer."""

    chat_template = "plain"
    eos_token = "|"

    def __len__(self) -> int:
        return SAMPLED + 1024

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        return "".join(f"<{m['role']}>{m['content']}|" for m in messages) + (
            "<a>" if add_generation_prompt else ""
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [ord(ch) % 1000 for ch in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return "x" * len(token_ids)

    def get_added_vocab(self) -> dict[str, int]:
        return {}


def target_length(prompt: list[int], choice: int, max_tokens: int, long_frac: float) -> int:
    """A long tail, the same in both runs: (1 - long_frac) of completions take 5-15% of max_tokens,
    the rest 50-100%."""
    digest = hashlib.sha256(f"{prompt}:{choice}".encode()).digest()
    u, v = digest[0] / 255, digest[1] / 255
    low, high = (0.5, 1.0) if u < long_frac else (0.05, 0.15)
    return max(1, round(max_tokens * (low + (high - low) * v)))


class SimulatedServer:
    """Samples one token per `token_seconds` for every live sequence under the policy its request
    started on, records whether the server held a newer policy then, and loads policies at once."""

    def __init__(self, token_seconds: float, long_frac: float) -> None:
        self.token_seconds = token_seconds
        self.long_frac = long_frac
        self.version = 0
        self.num_sampled = 0

    async def _sample(self, request: GenerateRequest, interrupt: asyncio.Event | None) -> list[Completion]:
        prompt = request.prompt_token_ids
        num_kept = next((i for i, t in enumerate(reversed(prompt)) if t < SAMPLED), len(prompt))
        max_tokens = request.params.max_tokens
        assert max_tokens is not None
        if num_kept:
            targets = [prompt[-1] - SAMPLED]
        else:
            targets = [target_length(prompt, c, max_tokens, self.long_frac) for c in range(request.n)]
        started_on = self.version
        choices = [Completion([], [], "", ABORTED) for _ in targets]
        while any(c.finish_reason == ABORTED for c in choices):
            if interrupt is not None and interrupt.is_set():
                break
            await asyncio.sleep(self.token_seconds)
            for c, target in zip(choices, targets, strict=True):
                if c.finish_reason != ABORTED:
                    continue
                c.token_ids.append(SAMPLED + target)
                self.num_sampled += 1
                c.logprobs.append(encode_logprob(started_on, self.version > started_on))
                if num_kept + len(c.token_ids) == target:
                    c.finish_reason = "stop"
                elif len(c.token_ids) == max_tokens:
                    c.finish_reason = "length"
        return choices

    async def generate(self, request: GenerateRequest) -> list[Completion]:
        return await self._sample(request, None)

    async def generate_interruptible(
        self, request: GenerateRequest, interrupt: asyncio.Event
    ) -> list[Completion]:
        return await self._sample(request, interrupt)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        match = re.search(r"step_(\d+)$", path)
        assert match is not None
        self.version = int(match.group(1))

    def end_session(self, session_id: str) -> None:
        return None

    def pool_metrics(self) -> dict[str, int]:
        return {}


class SimulatedTrainer(threading.Thread):
    """Takes batch n, counts its loss tokens, trains for `train_seconds`, publishes policy n + 1."""

    def __init__(self, run_dir: Path, num_steps: int, train_seconds: float) -> None:
        super().__init__(daemon=True)
        self.batches: queue.Queue[TrainingBatch] = queue.Queue(maxsize=1)
        self.run_dir = run_dir
        self.num_steps = num_steps
        self.train_seconds = train_seconds
        self.counts = {"trained_tokens": 0, "stale_tokens": 0, "lag_sum": 0, "max_lag": 0}

    def send(self, batch: TrainingBatch) -> None:
        self.batches.put(batch)

    def close(self) -> None:
        return None

    def run(self) -> None:
        for step in range(self.num_steps):
            batch = self.batches.get()
            for row in batch.rows:
                versions, stale = decode_logprobs(row.inference_logprobs[row.loss_mask])
                self.counts["trained_tokens"] += len(versions)
                self.counts["stale_tokens"] += int(stale.sum())
                self.counts["lag_sum"] += int((step - versions).sum())
                self.counts["max_lag"] = max(self.counts["max_lag"], int((step - versions).max(initial=0)))
            time.sleep(self.train_seconds)
            final = self.run_dir / "broadcasts" / f"step_{step + 1}"
            publish_dir(staging_dir(final), final)


async def run_once(args: argparse.Namespace, run_dir: Path, partial: bool) -> dict[str, float]:
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "bench", "lora_adapter": "default"},
            "batch_size": args.batch_size,
            "rollouts_per_example": args.rollouts_per_example,
            "max_steps": args.steps,
            "seq_len": 4096,
            "max_async_level": 1,
            "max_off_policy_steps": args.max_off_policy_steps,
            "partial_rollouts": partial,
            "sampling": {"max_tokens": args.max_tokens},
        }
    )
    env = SingleTurnEnv(
        examples=[{"prompt": f"question {i}"} for i in range(64)], rewards=[lambda completion: 1.0]
    )
    server = SimulatedServer(args.token_seconds, args.long_frac)
    trainer = SimulatedTrainer(run_dir, args.steps, args.train_seconds)
    trainer.start()
    orch = Orchestrator(cfg, server, trainer, run_dir, ChatTokenizer(CharTokenizer()), [env])  # type: ignore[arg-type]
    started = time.perf_counter()
    await orch.run()
    seconds = time.perf_counter() - started
    trainer.join()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    counts = trainer.counts
    trained = counts["trained_tokens"]
    return {
        "seconds": seconds,
        "sampled_tokens": server.num_sampled,
        "trained_tokens": trained,
        "untrained_tokens": server.num_sampled - trained,
        "trained_tokens_per_second": trained / seconds,
        "stale_tokens": counts["stale_tokens"],
        "stale_frac": counts["stale_tokens"] / trained,
        "kept_tokens": sum(r.get("partial/num_recovered_tokens", 0) for r in rows),
        "resumed_rollouts": sum(r.get("partial/num_resumed_rollouts", 0) for r in rows),
        "dropped_rollouts": sum(r["off_policy/num_dropped"] for r in rows),
        "mean_token_lag": counts["lag_sum"] / trained,
        "max_token_lag": counts["max_lag"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rollouts-per-example", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--long-frac", type=float, default=0.2, help="share of completions near max_tokens")
    parser.add_argument("--token-seconds", type=float, default=0.002, help="simulated decode time per token")
    parser.add_argument("--train-seconds", type=float, default=0.2, help="simulated trainer time per batch")
    parser.add_argument("--max-off-policy-steps", type=int, default=1)
    parser.add_argument("--machine", default=re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()))
    args = parser.parse_args()
    results = {}
    for label, partial in (("off", False), ("on", True)):
        with tempfile.TemporaryDirectory() as tmp:
            results[label] = asyncio.run(run_once(args, Path(tmp), partial))
    off, on = results["off"], results["on"]
    results["ratios"] = {
        "stale_tokens_on_over_off": on["stale_tokens"] / max(off["stale_tokens"], 1),
        "kept_tokens_over_trained_on": on["kept_tokens"] / on["trained_tokens"],
        "mean_token_lag_on_over_off": on["mean_token_lag"] / off["mean_token_lag"],
        "trained_tokens_per_second_on_over_off": on["trained_tokens_per_second"]
        / off["trained_tokens_per_second"],
    }
    report = {
        "machine": args.machine,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("numpy", "pydantic")},
        "config": {k: v for k, v in vars(args).items() if k != "machine"},
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "results": results,
    }
    out = Path(__file__).parent / "results" / f"partial_{args.machine}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
