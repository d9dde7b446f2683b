"""One rank of the data-parallel tests (run by torchrun from test_distributed.py and
test_dist_resume.py; not a test module).

Usage: torchrun --standalone --nproc_per_node N dist_worker.py SCENARIO MODEL_PATH OUT_DIR lora|full|lora,full
  (`step`, `train` and `resume` take both modes in one launch, one after the other, each in
  OUT_DIR/<mode>: one start-up of torchrun and the imports serve both)
  step     rank 0 alone builds a batch and shares it; every rank checks what it received, trains one
           step, and rank 0 writes the trainable parameters and their gradients to OUT_DIR/rank0.safetensors.
  train    two trainer runs through grpo.trainer.entry.run (rank 0 receiving `run_batch(n)`):
           OUT_DIR/whole trains 4 steps; OUT_DIR/split trains 2 steps and is stopped while waiting for
           batch 2 (checkpoints every 2 steps).
  resume   OUT_DIR/split resumes from its latest checkpoint and trains steps 2 and 3; then a Trainer
           resumed from OUT_DIR/whole scores `distributed_test_batch()` rows, every rank passing them
           (OUT_DIR/score_rank{r}.safetensors) and rank 0's rows shared (score_shared_rank{r}).
  late     OUT_DIR/late trains LATE_STEPS steps through grpo.trainer.entry.run with dist_timeout
           LATE_DIST_TIMEOUT_S, rank 0 getting batch 1 only after LATE_WAIT_S (longer than that), and
           checkpoints at the end.
  orphan   (started without torchrun, see `start_without_agent`) rank 0 exits while rank 1 waits
           for a batch from it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from torchrun_launch import run_under_torchrun
from trainer_batches import distributed_test_batch, distributed_test_cfg, make_row

from grpo.transport.batches.batch import TrainingBatch

NUM_STEPS = 4
STOP_AT = 2
CKPT_INTERVAL = 2
LATE_STEPS = 2
LATE_DIST_TIMEOUT_S = 5.0
LATE_WAIT_S = 12.0
ORPHAN_EXIT_CODE = 3
DIST_TIMEOUT_S = 300.0


def launch(scenario: str, model_path: Path, out_dir: Path, mode: str, num_ranks: int = 2) -> None:
    """Run `scenario` on `num_ranks` gloo ranks under torchrun; AssertionError with its stderr if it fails."""
    num_modes = len(mode.split(","))
    run_under_torchrun(
        __file__, [scenario, str(model_path), str(out_dir), mode], num_ranks, timeout_s=300 * num_modes
    )


def start_without_agent(scenario: str, out_dir: Path, master_port: int, num_ranks: int = 2) -> list[Any]:
    """The ranks of `scenario` as plain processes (env:// as torchrun describes it, but no agent:
    rank 0 hosts the process group's store, and nobody stops the other ranks when it dies). Each
    one's output goes to OUT_DIR/rank{r}.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WORLD_SIZE": str(num_ranks)}
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)})
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    processes = []
    for rank in range(num_ranks):
        with open(out_dir / f"rank{rank}.log", "w") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, __file__, scenario, "-", str(out_dir), "lora"],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return processes


def run_batch(step: int) -> TrainingBatch:
    """Batch `step` of the train/resume runs: three rows of unequal length, different each step."""
    rows = [
        make_row([(5, 6), (4, 7)], [1.0, -1.0], seed=3 * step, temperature=0.8),
        make_row([(6, 5), (3, 4), (4, 4)], [0.5, -0.5, 1.5], seed=3 * step + 1),
        make_row([(3, 9)], [-2.0 + step], seed=3 * step + 2),
    ]
    for row in rows:
        row.inference_logprobs = np.where(row.loss_mask, -6.5, 0.0).astype(np.float32)
    return TrainingBatch(step=step, rows=rows)


def run_cfg(model_path: str, run_dir: Path, mode: str, resume: bool) -> Any:
    cfg = distributed_test_cfg(model_path, lora=mode == "lora")
    ckpt = {"interval": CKPT_INTERVAL, "resume_step": -1 if resume else None}
    return cfg.model_copy(
        update={"output_dir": str(run_dir), "max_steps": NUM_STEPS, "ckpt": cfg.ckpt.model_copy(update=ckpt)}
    )


class StoppingReceiver:
    """Delivers run_batch(n); asked for batch `stop_at`, it sets `stop` instead (as a Ctrl-C would)."""

    def __init__(self, stop_at: int, stop: threading.Event) -> None:
        self.stop_at = stop_at
        self.stop = stop

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch:
        if step >= self.stop_at:
            self.stop.set()
            raise TimeoutError
        return run_batch(step)

    def commit(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class LateReceiver:
    """Delivers run_batch(n), batch 1 only after LATE_WAIT_S (an orchestrator that is slow, or restarting)."""

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch:
        if step == 1:
            time.sleep(LATE_WAIT_S)
        return run_batch(step)

    def commit(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def late(model_path: str, out_dir: Path, mode: str, is_main: bool) -> None:
    from grpo.trainer.entry import run

    cfg = run_cfg(model_path, out_dir / "late", mode, resume=False)
    ckpt = cfg.ckpt.model_copy(update={"interval": LATE_STEPS})
    cfg = cfg.model_copy(update={"max_steps": LATE_STEPS, "dist_timeout": LATE_DIST_TIMEOUT_S, "ckpt": ckpt})
    run(cfg, Path(cfg.output_dir), LateReceiver() if is_main else None)


def orphan(ctx: Any) -> None:
    from grpo.trainer.distributed import share_batch

    if ctx.is_main:
        time.sleep(2.0)  # rank 1 is waiting for the first batch by now
        os._exit(ORPHAN_EXIT_CODE)
    share_batch(None, ctx)
    raise AssertionError("rank 1 got a batch from a rank 0 that exited")


def _run(cfg: Any, is_main: bool, stop_at: int) -> None:
    from grpo.trainer.entry import run

    stop = threading.Event()
    receiver = StoppingReceiver(stop_at, stop) if is_main else None
    run(cfg, Path(cfg.output_dir), receiver, stop=stop)


def _full(tensor):
    """The whole tensor on every rank (FSDP2 parameters are sharded DTensors; a collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def one_step(model_path: str, out_dir: Path, mode: str) -> None:
    import torch
    from safetensors.torch import save_file

    from grpo.trainer.hf.trainer import Trainer

    trainer = Trainer(distributed_test_cfg(model_path, lora=mode == "lora"), out_dir / "run")
    assert trainer.dist is not None, "run me under torchrun with more than one process"
    expected = distributed_test_batch()
    batch = trainer.share_batch(expected if trainer.is_main else None)
    assert batch is not None and batch.step == expected.step and len(batch.rows) == len(expected.rows)
    assert batch.sampling == expected.sampling
    for got, want in zip(batch.rows, expected.rows, strict=True):
        for name in ("input_ids", "position_ids", "loss_mask", "advantages", "temperatures"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
    metrics = trainer.train_step(batch)
    assert trainer.share_batch(None) is None  # the stop message reaches every rank
    tensors: dict[str, torch.Tensor] = {}
    for name, param in trainer.policy.model.named_parameters():
        if param.requires_grad:
            tensors[f"param.{name}"] = _full(param.detach()).float().contiguous()
            tensors[f"grad.{name}"] = _full(param.grad.detach()).float().contiguous()
    if trainer.is_main:
        tensors["metrics.tokens"] = torch.tensor([metrics["tokens"]])
        tensors["metrics.loss"] = torch.tensor([metrics["loss"]])
        save_file(tensors, str(out_dir / "rank0.safetensors"))
    trainer.close()


def train(model_path: str, out_dir: Path, mode: str, is_main: bool) -> None:
    _run(run_cfg(model_path, out_dir / "whole", mode, resume=False), is_main, stop_at=NUM_STEPS)
    _run(run_cfg(model_path, out_dir / "split", mode, resume=False), is_main, stop_at=STOP_AT)


def resume(model_path: str, out_dir: Path, mode: str, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    from grpo.trainer.hf.trainer import Trainer

    _run(run_cfg(model_path, out_dir / "split", mode, resume=True), rank == 0, stop_at=NUM_STEPS)
    trainer = Trainer(run_cfg(model_path, out_dir / "whole", mode, resume=True), out_dir / "whole")
    assert trainer.maybe_resume() == NUM_STEPS
    rows = distributed_test_batch().rows
    for name, scores in (
        ("score", trainer.score(rows)),
        ("score_shared", trainer.score(rows if rank == 0 else None, share_rows=True)),
    ):
        tensors = {f"row{i}": torch.from_numpy(s) for i, s in enumerate(scores)}
        save_file(tensors, str(out_dir / f"{name}_rank{rank}.safetensors"))
    trainer.close()


def main() -> None:
    import torch.distributed as dist

    from grpo.trainer.distributed import init_distributed

    scenario, model_path, out_dir, mode = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    # The first init_distributed creates the group: the Trainers built later join it as it is.
    ctx = init_distributed("cpu", LATE_DIST_TIMEOUT_S if scenario == "late" else DIST_TIMEOUT_S)
    assert ctx is not None, "run me under torchrun with more than one process"
    if scenario in ("step", "train", "resume"):
        modes = mode.split(",")
        for one_mode in modes:
            mode_dir = out_dir / one_mode if len(modes) > 1 else out_dir
            if scenario == "step":
                one_step(model_path, mode_dir, one_mode)
            elif scenario == "train":
                train(model_path, mode_dir, one_mode, ctx.is_main)
            else:
                resume(model_path, mode_dir, one_mode, ctx.rank)
    elif scenario == "late":
        late(model_path, out_dir, mode, ctx.is_main)
    elif scenario == "orphan":
        orphan(ctx)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
