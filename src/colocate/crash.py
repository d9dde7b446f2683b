"""What a co-located run prints when its inference engine dies: the checkpoint it can resume from
and the exact command that resumes it.

The engine cannot be restarted in place (the trainer's base weights are the engine's own memory),
so the run ends; its checkpoints (ckpt.interval) stay, and `ckpt.resume_step -1` picks the newest
step both sides checkpointed (grpo.orchestrator.checkpoint.resolve_colocated_resume).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from grpo.orchestrator.checkpoint import stable_steps
from grpo.transport.run_dir import complete_trainer_checkpoints

RESUME_KEYS = ("--train.ckpt.resume_step", "--orch.ckpt.resume_step")


def resume_command(argv: list[str], cwd: str | None = None) -> str:
    """`grpo` with the arguments `argv` had (the program's own path first), any resume_step override
    replaced by --train.ckpt.resume_step -1 (it sets both sides), run from `cwd`."""
    args: list[str] = []
    skip_value = False
    for arg in argv[1:]:
        if skip_value:
            skip_value = False
        elif arg in RESUME_KEYS:
            skip_value = True
        elif not arg.startswith(tuple(f"{key}=" for key in RESUME_KEYS)):
            args.append(arg)
    command = shlex.join(["grpo", *args, "--train.ckpt.resume_step", "-1"])
    return f"cd {shlex.quote(cwd or os.getcwd())} && {command}"


def resume_step(run_dir: Path) -> int | None:
    """The step `ckpt.resume_step -1` resumes from: the newest both sides checkpointed (None: step 0)."""
    common = set(complete_trainer_checkpoints(run_dir)) & set(stable_steps(run_dir))
    return max(common) if common else None


def engine_crash_message(run_dir: Path, reason: str, argv: list[str]) -> str:
    step = resume_step(run_dir)
    where = (
        f"from step {step}, the newest step both the trainer and the orchestrator checkpointed in {run_dir}"
        if step is not None
        else f"from step 0: no step of {run_dir} has a checkpoint on both sides (set ckpt.interval to keep them)"
    )
    return (
        f"the inference engine died ({reason}); the run stopped, every process ended. "
        f"Resume {where}:\n  {resume_command(argv)}"
    )
