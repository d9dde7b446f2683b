"""Megatron checkpoints on one rank: a run stopped after step 2 and resumed by a new trainer takes
the uninterrupted run's step 3; a torn checkpoint is ignored; another layout is refused."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from trainer_batches import make_row

from grpo.config.trainer import TrainerConfig
from grpo.transport.batches.batch import TrainingBatch
from grpo.utils.errors import UserError
from grpo.utils.jsonl import read_jsonl

if TYPE_CHECKING:
    from grpo.trainer.megatron.trainer import MegatronTrainer

COMPARED_METRICS = (
    "loss",
    "mismatch_kl",
    "entropy",
    "masked",
    "tokens",
    "grad_norm",
    "grad_norm_before_clip",
    "lr",
    "skipped_steps",
)


def batch(step: int) -> TrainingBatch:
    """Batch `step`, the same in every run (off-policy logprobs fixed, not scored by the trainer)."""
    rows = [
        make_row([(6, 10), (4, 12)], [1.0, -1.0], seed=10 * step + 1, temperature=0.7),
        make_row([(9, 7)], [0.5], seed=10 * step + 2),
    ]
    for row in rows:
        row.inference_logprobs = np.where(row.loss_mask, -10.5, 0.0).astype(np.float32)
    return TrainingBatch(step=step, rows=rows)


@pytest.fixture
def resume_cfg(megatron_cfg: Callable[..., TrainerConfig]) -> Callable[..., TrainerConfig]:
    def make(run_dir: Path, use_distributed_optimizer: bool = True) -> TrainerConfig:
        return megatron_cfg(
            output_dir=str(run_dir),
            max_steps=3,
            max_grad_norm=0.5,
            lr_scheduler_type="cosine",  # the schedule's position is restored too
            warmup_steps=1,
            megatron={"use_distributed_optimizer": use_distributed_optimizer},
            ckpt={"interval": 2, "resume_step": -1},
        )

    return make


def _train(trainer: MegatronTrainer, steps: range) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for step in steps:
        metrics = trainer.train_step(batch(step))
    return metrics


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=["float32", "bf16"]
)
@pytest.mark.parametrize("use_distributed_optimizer", [True, False], ids=["distributed", "plain"])
def test_a_resumed_run_takes_the_uninterrupted_runs_third_step(
    use_distributed_optimizer: bool,
    dtype: torch.dtype,
    resume_cfg: Callable[..., TrainerConfig],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    # bf16 weights with fp32 main weights in the optimizer: both must come back.
    monkeypatch.setattr("grpo.trainer.device.choose_dtype", lambda device: dtype)
    whole = MegatronTrainer(resume_cfg(tmp_path / "whole", use_distributed_optimizer), tmp_path / "whole")
    whole_metrics = _train(whole, range(3))
    whole_weights = whole.hf_state_dict()
    whole.close()

    split_dir = tmp_path / "split"
    first = MegatronTrainer(resume_cfg(split_dir, use_distributed_optimizer), split_dir)
    assert first.maybe_resume() == 0  # nothing to resume yet
    _train(first, range(2))
    first.save_checkpoint()
    _train(first, range(2, 3))  # logged, never checkpointed: the resumed run trains it again
    first.close()
    torch.manual_seed(1234)  # the checkpoint's RNG state must win over whatever the process holds

    resumed = MegatronTrainer(resume_cfg(split_dir, use_distributed_optimizer), split_dir)
    assert resumed.maybe_resume() == 2
    assert resumed.num_steps_done == 2
    assert [r["step"] for r in read_jsonl(split_dir / "trainer_metrics.jsonl")] == [0, 1]
    resumed_metrics = _train(resumed, range(2, 3))
    resumed_weights = resumed.hf_state_dict()
    resumed.close()

    assert [r["step"] for r in read_jsonl(split_dir / "trainer_metrics.jsonl")] == [0, 1, 2]
    for key in COMPARED_METRICS:
        assert resumed_metrics[key] == whole_metrics[key], key
    assert whole_weights is not None and resumed_weights is not None
    for name, tensor in whole_weights.items():
        assert torch.equal(resumed_weights[name], tensor), name


@pytest.fixture
def one_checkpoint(resume_cfg: Callable[..., TrainerConfig], float32_compute: None, tmp_path: Path) -> Path:
    """A run dir holding checkpoint step_1 (distributed optimizer)."""
    from grpo.trainer.megatron.trainer import MegatronTrainer

    run_dir = tmp_path / "run"
    trainer = MegatronTrainer(resume_cfg(run_dir), run_dir)
    _train(trainer, range(1))
    trainer.save_checkpoint()
    trainer.close()
    return run_dir


def test_a_torn_checkpoint_is_ignored(one_checkpoint: Path, resume_cfg: Callable[..., TrainerConfig]) -> None:
    from grpo.trainer.checkpoint import checkpoint_dir
    from grpo.trainer.megatron.trainer import MegatronTrainer
    from grpo.utils.atomic import STABLE

    torn = checkpoint_dir(one_checkpoint, 2)
    shutil.copytree(checkpoint_dir(one_checkpoint, 1), torn)
    (torn / STABLE).unlink()  # killed before its STABLE marker
    trainer = MegatronTrainer(resume_cfg(one_checkpoint), one_checkpoint)
    try:
        assert trainer.maybe_resume() == 1
    finally:
        trainer.close()


def test_a_checkpoint_of_another_layout_is_refused_naming_both(
    one_checkpoint: Path, resume_cfg: Callable[..., TrainerConfig]
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(resume_cfg(one_checkpoint, use_distributed_optimizer=False), one_checkpoint)
    try:
        with pytest.raises(UserError) as refused:
            trainer.maybe_resume()
    finally:
        trainer.close()
    line = str(refused.value)
    assert "\n" not in line
    assert "tp 1 pp 1 ep 1 distributed optimizer" in line and "tp 1 pp 1 ep 1 plain optimizer" in line


def test_a_checkpoint_of_the_other_backend_is_refused_in_one_line(tmp_path: Path) -> None:
    from grpo.trainer.checkpoint import STATE_FILE
    from grpo.trainer.megatron.checkpoint import read_state
    from grpo.trainer.megatron.parallel import ParallelRanks

    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 2, "world_size": 1}))  # what backend hf writes
    ranks = ParallelRanks(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1)
    with pytest.raises(
        UserError, match=r"^checkpoint .* was written by backend hf; resume it with backend: hf"
    ):
        read_state(tmp_path, ranks, use_distributed_optimizer=True)


class _Batches:
    """A batch transport that hands out batch(step) and records what it was asked for."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.commits: list[int] = []

    def receive(self, step: int, timeout: float | None = None) -> TrainingBatch:
        self.received.append(step)
        return batch(step)

    def commit(self, step: int) -> None:
        self.commits.append(step)

    def close(self) -> None:
        pass


@pytest.mark.usefixtures("float32_compute")
def test_the_trainer_loop_resumes_at_the_checkpointed_step_and_republishes_it(
    resume_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from grpo.trainer.entry import run
    from grpo.utils.atomic import is_stable

    cfg = resume_cfg(tmp_path)  # checkpoints every 2 steps, max_steps 3
    stopped = _Batches()
    run(cfg.model_copy(update={"max_steps": 2}), tmp_path, stopped)
    assert stopped.received == [0, 1] and stopped.commits == [2]
    (tmp_path / "broadcasts" / "step_2" / "STABLE").unlink()  # as if killed before it was published

    resumed = _Batches()
    run(cfg, tmp_path, resumed)
    assert resumed.received == [2]
    assert [r["step"] for r in read_jsonl(tmp_path / "trainer_metrics.jsonl")] == [0, 1, 2]
    assert is_stable(tmp_path / "broadcasts" / "step_2") and is_stable(tmp_path / "broadcasts" / "step_3")
