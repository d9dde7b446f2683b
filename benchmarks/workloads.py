"""The two workloads of the grpo-vs-TRL speed comparison (`make bench`), defined once for both sides.

The issue's settings: the embedded SmolLM2-135M-Instruct, 8 prompts x 8 completions per step,
24 new tokens, LoRA r16 alpha 32 on all linear layers, lr 1e-4, temperature 1.0; grpo
co-located at max_async_level 1 with the configs/bench/ configs (default dtype). The workloads
differ only in the prompt: short-answer (~30 prompt tokens) and long-brief (the same questions
behind a fixed ~350-token system brief, the regime of agent and tool-use prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

BENCH_CONFIGS = "configs/bench"


@dataclass(frozen=True)
class Workload:
    name: str
    """Environment id, also the tag of the result files."""
    prompts: int = 8
    group: int = 8
    max_tokens: int = 24
    lr: float = 1e-4
    steps: int = 10
    """Steps per run in `make bench`: long-brief runs fewer, since TRL takes minutes per step there
    and the point of that workload is the step time, not the reward curve."""

    def task_args(self, steps: int) -> list[str]:
        """The flags e2e_bench.py and trl_bench.py share, so both sides run the same task."""
        return [
            *("--env", self.name, "--steps", str(steps), "--prompts", str(self.prompts)),
            *("--group", str(self.group), "--max-tokens", str(self.max_tokens), "--lr", str(self.lr)),
        ]


WORKLOADS = {w.name: w for w in (Workload("short-answer"), Workload("long-brief", steps=5))}
