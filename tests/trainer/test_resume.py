"""Kill a trainer process with SIGKILL after step k and resume it: steps continue at k + 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo.trainer.checkpoint import complete_checkpoints
from grpo.utils.atomic import is_stable
from grpo.utils.jsonl import JsonlWriter, drop_metrics_from, read_jsonl

# The trainer process: `run` with a receiver that makes batch n deterministically from n, and
# blocks forever on batches >= block_at (so the kill lands at a known point).
_TRAINER_SCRIPT = """
import json, sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from trainer_batches import make_row
from grpo.config.trainer import TrainerConfig
from grpo.trainer.entry import run
from grpo.transport.batches.batch import TrainingBatch

cfg = TrainerConfig(**json.loads(sys.argv[1]))
block_at = int(sys.argv[2])

class FakeReceiver:
    def receive(self, step, timeout=None):
        if step >= block_at:
            threading.Event().wait()
        row = make_row([(4, 6), (3, 5)], [1.0, -1.0], seed=step)
        row.inference_logprobs[row.loss_mask] = -10.8
        return TrainingBatch(step=step, rows=[row])
    def commit(self, step):
        pass
    def close(self):
        pass

run(cfg, Path(cfg.output_dir), FakeReceiver())
"""


def _start(cfg: dict, block_at: int) -> subprocess.Popen:
    here = str(Path(__file__).parent)
    return subprocess.Popen(
        [sys.executable, "-c", _TRAINER_SCRIPT, json.dumps(cfg), str(block_at), here],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.slow
def test_sigkilled_trainer_resumes_at_the_next_step_without_gaps_or_repeats(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    loss = {"token_mask_low": 0.0, "geo_mask_low": 0.0}
    cfg = make_cfg(output_dir=str(run_dir), max_steps=5, ckpt={"interval": 1, "keep_last": 2}, loss=loss)
    k = 2
    first = _start(cfg.model_dump(), block_at=k + 1)
    try:
        deadline = time.monotonic() + 120
        while (k + 1) not in complete_checkpoints(run_dir):
            assert first.poll() is None, first.stderr.read().decode() if first.stderr else ""
            assert time.monotonic() < deadline, "trainer did not reach the checkpoint in time"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait(timeout=30)
    assert [r["step"] for r in read_jsonl(run_dir / "trainer_metrics.jsonl")] == [0, 1, 2]

    resumed_cfg = cfg.model_copy(update={"ckpt": cfg.ckpt.model_copy(update={"resume_step": -1})})
    second = _start(resumed_cfg.model_dump(), block_at=10**9)
    _, stderr = second.communicate(timeout=180)
    assert second.returncode == 0, stderr.decode()
    assert "next batch is step 3" in stderr.decode()
    assert [r["step"] for r in read_jsonl(run_dir / "trainer_metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert sorted(complete_checkpoints(run_dir)) == [4, 5]  # keep_last 2
    assert is_stable(run_dir / "broadcasts" / "step_5")


def test_drop_metrics_from_cuts_rows_of_redone_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "trainer_metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)) + '{"step": 4, "lo')
    assert drop_metrics_from(path, 2) == 3
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]
    assert drop_metrics_from(path, 2) == 0  # idempotent
    assert drop_metrics_from(tmp_path / "missing.jsonl", 0) == 0


def test_a_torn_last_line_does_not_swallow_the_next_row(tmp_path):
    """A writer already holding the file open (append mode) keeps appending after the cut."""
    path = tmp_path / "trainer_metrics.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n" + '{"step": 1, "lo')
    writer = JsonlWriter(path)
    try:
        drop_metrics_from(path, 1)
        writer.write({"step": 1})
    finally:
        writer.close()
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]


def test_resume_rewinds_trainer_metrics_and_refuses_other_shapes(make_cfg, tmp_path):
    """Killed after logging step 1 but before checkpoint 2: resuming from checkpoint 1 trains step 1
    again, so its old row goes. A checkpoint of another lora_rank is one clear ValueError."""
    from trainer_batches import default_rows, on_policy_batch

    from grpo.trainer.hf.trainer import Trainer

    cfg = make_cfg(output_dir=str(tmp_path), max_steps=3, ckpt={"interval": 1, "resume_step": -1})
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
        trainer.save_checkpoint()
        trainer.train_step(on_policy_batch(trainer, 1, default_rows(seed=5)))  # logged, never checkpointed
    finally:
        trainer.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "trainer_metrics.jsonl")] == [0, 1]

    resumed = Trainer(cfg, tmp_path)
    try:
        assert resumed.maybe_resume() == 1
        assert [r["step"] for r in read_jsonl(tmp_path / "trainer_metrics.jsonl")] == [0]
        resumed.train_step(on_policy_batch(resumed, 1, default_rows(seed=5)))
    finally:
        resumed.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "trainer_metrics.jsonl")] == [0, 1]

    other_rank = Trainer(make_cfg(output_dir=str(tmp_path), lora_rank=8, ckpt={"resume_step": -1}), tmp_path)
    try:
        with pytest.raises(ValueError, match=r"other shapes .*lora_rank"):
            other_rank.maybe_resume()
    finally:
        other_rank.close()


def test_a_megatron_checkpoint_is_refused_in_one_line(tmp_path):
    from grpo.trainer.checkpoint import STATE_FILE
    from grpo.trainer.hf.checkpoint import load_checkpoint
    from grpo.utils.errors import UserError

    (tmp_path / STATE_FILE).write_text(json.dumps({"backend": "megatron", "step": 2, "world_size": 1}))
    with pytest.raises(UserError, match=r"written by backend megatron; resume it with backend: megatron"):
        load_checkpoint(tmp_path, policy=None, optimizer=None, scheduler=None)
