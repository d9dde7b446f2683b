"""Trainer checkpoints: `{run_dir}/checkpoints/trainer/step_{n}/` holds the state after n optimizer
steps (trainable weights, optimizer, scheduler, RNG), STABLE last. Resuming from step_n continues
with batch n.

Files: `trainable.safetensors` (trainable parameters by name), `optimizer.pt` / `scheduler.pt`
(torch.save of state dicts, loaded with weights_only=True; only this trainer writes them),
`rng.pt` (torch RNG tensors) and `trainer_state.json` (step, python/numpy RNG as JSON).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from grpo.trainer.publish import prune_step_dirs
from grpo.utils.atomic import is_stable, publish_dir, staging_dir

if TYPE_CHECKING:
    import torch

    from grpo.trainer.model import Policy

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "trainer"


def complete_checkpoints(run_dir: Path) -> dict[int, Path]:
    root = checkpoint_root(run_dir)
    if not root.exists():
        return {}
    found = {}
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and is_stable(path):
            found[int(match.group(1))] = path
    return found


def save_checkpoint(
    run_dir: Path,
    step: int,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    keep_last: int | None,
) -> Path:
    import torch
    from safetensors.torch import save_file

    final = checkpoint_root(run_dir) / f"step_{step}"
    staged = staging_dir(final)
    trainable = {
        n: p.detach().cpu().contiguous() for n, p in policy.model.named_parameters() if p.requires_grad
    }
    save_file(trainable, str(staged / "trainable.safetensors"))
    torch.save(optimizer.state_dict(), staged / "optimizer.pt")
    torch.save(scheduler.state_dict(), staged / "scheduler.pt")
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    torch.save(rng, staged / "rng.pt")
    py_state = random.getstate()
    np_state = np.random.get_state(legacy=False)
    np_state["state"] = {**np_state["state"], "key": np_state["state"]["key"].tolist()}
    state = {
        "step": step,
        "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy_rng": np_state,
    }
    (staged / "trainer_state.json").write_text(json.dumps(state))
    publish_dir(staged, final)
    if keep_last is not None:
        prune_step_dirs(final.parent, keep=keep_last)
    return final


def find_resume_checkpoint(run_dir: Path, resume_step: int | None) -> tuple[int, Path] | None:
    """(step, folder) to resume from: None = start fresh, -1 = latest complete, n = exactly step n."""
    if resume_step is None:
        return None
    found = complete_checkpoints(run_dir)
    if resume_step == -1:
        if not found:
            return None
        latest = max(found)
        return latest, found[latest]
    if resume_step == 0:
        return None
    if resume_step not in found:
        raise ValueError(
            f"ckpt.resume_step {resume_step}: no complete checkpoint {checkpoint_root(run_dir)}/step_{resume_step}; "
            f"available: {sorted(found) or 'none'} (use resume_step: -1 for the latest)"
        )
    return resume_step, found[resume_step]


def load_checkpoint(
    folder: Path,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Restore state in place; return the step (optimizer steps done)."""
    import torch
    from safetensors.torch import load_file

    trainable = load_file(str(folder / "trainable.safetensors"))
    params = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    if set(trainable) != set(params):
        raise ValueError(
            f"checkpoint {folder} was written for different trainable parameters (another LoRA config?)"
        )
    with torch.no_grad():
        for name, tensor in trainable.items():
            params[name].copy_(tensor)
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    rng = torch.load(folder / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(rng["cuda"]))
    state = json.loads((folder / "trainer_state.json").read_text())
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy_rng"]
    np_state["state"]["key"] = np.array(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)
    return int(state["step"])
