"""vLLM's CPU engine processes wait for each other's messages without spinning.

On CPU vLLM always runs its model in a worker process beside the engine core (the "mp" executor:
vllm.platforms.cpu). The two hand each step's scheduler output and model output over a
shared-memory queue whose reader, after each message, keeps checking for the next one in a
sched_yield loop for a whole second (`SpinCondition.busy_loop_s`) before it blocks on the writer's
notification socket. Every step is shorter than that, so one of the two processes is always
spinning: on a machine of a few cores it takes a core from the worker's matmul threads, and in a
co-located run from the trainer's. Here the readers block at once; the writer notifies every
message, so the cost is one socket wake-up per message (tens of microseconds, against steps of
tens to hundreds of milliseconds).

Measured on 2 AVX512-BF16 cores, the short-answer batch (8 prompts x 8 completions x 24 tokens,
bf16, 16-token blocks), vLLM's offline engine with its default processes, 4 rounds each way, two
passes in turns: 3.26-4.36 s a round spinning, 2.94-3.73 s blocking.
"""

from __future__ import annotations

from typing import Any


def block_cpu_queue_readers() -> None:
    """Make the engine's shared-memory queue readers block from their first wait (module docstring).

    Must run in the engine core and the worker, which vLLM-CPU spawns: grpo's vLLM plugin
    (grpo.inference.vllm_compat.plugin) calls it there. Idempotent; a no-op off CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    original = SpinCondition.wait
    if getattr(original, "_grpo_blocks", False):
        return

    # `wait` rather than `__init__`: a queue the process made before the plugin ran blocks too
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = 0.0
        original(self, timeout_ms)

    wait._grpo_blocks = True  # type: ignore[attr-defined]
    wait._grpo_original = original  # type: ignore[attr-defined]
    SpinCondition.wait = wait
