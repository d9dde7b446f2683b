"""The workloads of the grpo-vs-TRL comparison (`make bench`), defined once for both sides.

The issue's settings: the embedded SmolLM2-135M-Instruct, 8 prompts x 8 completions per step,
24 new tokens, LoRA r16 alpha 32 on all linear layers, lr 1e-4, temperature 1.0; grpo
co-located at max_async_level 1 with the configs/bench/ configs (default dtype). short-answer and
long-brief differ only in the prompt: short-answer (~30 prompt tokens) and long-brief (the same
questions behind a fixed ~350-token system brief, the regime of agent and tool-use prompts).
three-words (benchmarks/tasks/three_words.py) is a format task the model learns within ten steps,
for the learning-speed comparison (learning_bench.py).
"""

from __future__ import annotations

from dataclasses import dataclass

BENCH_CONFIGS = "configs/bench"


@dataclass(frozen=True)
class Workload:
    name: str
    """The tag of the result files."""
    env: str = ""
    """Environment id (default: name)."""
    prompts: int = 8
    group: int = 8
    max_tokens: int = 24
    lr: float = 1e-4
    steps: int = 10
    """Steps per run in `make bench`: long-brief runs fewer, since TRL takes minutes per step there
    and the point of that workload is the step time, not the reward curve."""
    learning_steps: int = 10
    """Steps per seed in learning_bench.py."""
    thresholds: tuple[float, ...] = ()
    """Rewards learning_bench.py times each side to (trailing mean over its window)."""

    @property
    def env_id(self) -> str:
        return self.env or self.name

    def task_args(self, steps: int) -> list[str]:
        """The flags e2e_bench.py and trl_bench.py share, so both sides run the same task."""
        return [
            *("--env", self.env_id, "--steps", str(steps), "--prompts", str(self.prompts)),
            *("--group", str(self.group), "--max-tokens", str(self.max_tokens), "--lr", str(self.lr)),
        ]


WORKLOADS = {
    w.name: w
    for w in (
        Workload("short-answer", learning_steps=12, thresholds=(0.22, 0.25)),
        Workload("long-brief", steps=5, learning_steps=10, thresholds=(0.2, 0.25)),
        Workload("three-words", env="three_words:load_environment", thresholds=(0.25, 0.3)),
    )
}
SPEED_WORKLOADS = ("short-answer", "long-brief")
"""The workloads run_all.py's speed comparison runs by default."""
