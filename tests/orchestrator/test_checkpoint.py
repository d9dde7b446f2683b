from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.config.orchestrator import CheckpointConfig
from grpo.orchestrator.checkpoint import (
    load_checkpoint,
    resolve_colocated_resume,
    resolve_resume_step,
    save_checkpoint,
    stable_steps,
)
from grpo.trainer.checkpoint import checkpoint_dir as trainer_checkpoint_dir
from grpo.trainer.checkpoint import complete_checkpoints
from grpo.utils.atomic import mark_stable
from grpo.utils.jsonl import read_jsonl


def test_save_load_round_trip_and_latest(tmp_path: Path) -> None:
    cfg = CheckpointConfig(interval=1)
    save_checkpoint(tmp_path, 2, {"counters": {"x": 1}}, {"num_sampled": 7}, cfg)
    save_checkpoint(tmp_path, 4, {"counters": {"x": 2}}, {"num_sampled": 9}, cfg)
    assert resolve_resume_step(tmp_path, -1) == 4
    progress, buffer_state = load_checkpoint(tmp_path, 2)
    assert progress == {"counters": {"x": 1}, "step": 2} and buffer_state == {"num_sampled": 7}


def test_missing_resume_step_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="resume_step=3"):
        resolve_resume_step(tmp_path, 3)
    assert resolve_resume_step(tmp_path, -1) is None


def test_keep_last_and_keep_interval_prune(tmp_path: Path) -> None:
    cfg = CheckpointConfig(interval=1, keep_last=2, keep_interval=3)
    for step in range(1, 8):
        save_checkpoint(tmp_path, step, {}, {}, cfg)
    assert stable_steps(tmp_path) == [3, 6, 7]


def _write_rows(path: Path, steps: list[int], torn: str = "") -> None:
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in steps) + torn)


def _trainer_checkpoint(run_dir: Path, step: int) -> None:
    """A STABLE trainer checkpoint folder (its contents do not matter to the resume decision)."""
    folder = trainer_checkpoint_dir(run_dir, step)
    folder.mkdir(parents=True)
    mark_stable(folder)


def _broadcast(run_dir: Path, version: int) -> None:
    folder = run_dir / "broadcasts" / f"step_{version}"
    folder.mkdir(parents=True)
    mark_stable(folder)


def test_loading_a_checkpoint_rewinds_metrics_to_the_steps_before_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 2, {}, {}, CheckpointConfig(interval=1))
    _write_rows(tmp_path / "metrics.jsonl", [0, 1, 2, 3], torn='{"step": 4, "rew')
    load_checkpoint(tmp_path, 2)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")


def test_colocated_resume_picks_the_newest_step_both_sides_checkpointed_and_drops_the_rest(
    tmp_path: Path,
) -> None:
    # A co-located run killed while training batch 2 with max_async_level 1: the orchestrator had
    # sent batches 2 and 3 (checkpoints 3, 4), the trainer had logged step 2 but not checkpointed it.
    cfg = CheckpointConfig(interval=1)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {}, {}, cfg)
    for step in (1, 2):
        _trainer_checkpoint(tmp_path, step)
    for version in (1, 2, 3):
        _broadcast(tmp_path, version)
    (tmp_path / "broadcasts" / ".step_4.tmp-123").mkdir()
    _write_rows(tmp_path / "metrics.jsonl", [0, 1, 2, 3])
    _write_rows(tmp_path / "trainer_metrics.jsonl", [0, 1, 2])

    assert resolve_colocated_resume(tmp_path, -1) == 2
    assert stable_steps(tmp_path) == [1, 2]
    assert sorted(complete_checkpoints(tmp_path)) == [1, 2]
    assert sorted(p.name for p in (tmp_path / "broadcasts").iterdir()) == ["step_1", "step_2"]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    assert [r["step"] for r in read_jsonl(tmp_path / "trainer_metrics.jsonl")] == [0, 1]


def test_colocated_resume_of_a_run_killed_before_its_first_checkpoint_starts_clean(tmp_path: Path) -> None:
    _broadcast(tmp_path, 1)  # policy 1 was published, checkpoint 1 never finished
    _write_rows(tmp_path / "trainer_metrics.jsonl", [0])
    assert resolve_colocated_resume(tmp_path, -1) is None
    # else the new run would sample from the old policy 1
    assert not list((tmp_path / "broadcasts").iterdir())
    assert read_jsonl(tmp_path / "trainer_metrics.jsonl") == []
    assert resolve_colocated_resume(tmp_path, None) is None


@pytest.mark.parametrize(
    ("resume_step", "match"),
    [(3, r"step 3 of .* no complete checkpoint on both sides .* use one of \[1, 2\]")],
)
def test_colocated_resume_mistakes_are_one_line_value_errors(
    tmp_path: Path, resume_step: int, match: str
) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {}, {}, CheckpointConfig(interval=1))
    for step in (1, 2):
        _trainer_checkpoint(tmp_path, step)
    with pytest.raises(ValueError, match=match) as error:
        resolve_colocated_resume(tmp_path, resume_step)
    assert "\n" not in str(error.value)
    assert stable_steps(tmp_path) == [1, 2, 3]  # a refused resume deletes nothing


def test_colocated_resume_without_a_common_step_says_how_to_checkpoint(tmp_path: Path) -> None:
    # orch keep_last 2 with max_async_level 1: its checkpoints ran past everything the trainer kept
    cfg = CheckpointConfig(interval=1, keep_last=2)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {}, {}, cfg)
    for step in (1, 2):
        _trainer_checkpoint(tmp_path, step)
    with pytest.raises(ValueError, match=r"same ckpt.interval.*keep_last >= max_async_level \+ 2"):
        resolve_colocated_resume(tmp_path, -1)


def test_colocated_resume_refuses_a_run_dir_of_other_weights(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, {}, {}, CheckpointConfig(interval=1))
    _trainer_checkpoint(tmp_path, 1)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "train.yaml").write_text("model: /models/a\nlora_rank: 8\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"other weights .*model '/models/a' -> '/models/b'"):
        resolve_colocated_resume(tmp_path, -1, {"model": "/models/b", "lora_rank": 8})
    # Hyperparameters that leave the weights' shapes alone may change on resume.
    assert (
        resolve_colocated_resume(tmp_path, -1, {"model": "/models/a", "lora_rank": 8, "learning_rate": 1})
        == 1
    )


def test_a_fresh_colocated_run_refuses_a_run_dir_holding_an_earlier_run(tmp_path: Path) -> None:
    (tmp_path / "configs").mkdir()  # a run killed during start-up leaves only its configs: fine
    assert resolve_colocated_resume(tmp_path, None) is None
    _broadcast(tmp_path, 6)  # a finished run: a new one would sample from its policy 6
    with pytest.raises(ValueError, match=r"holds an earlier run \(policies \[6\].*resume_step -1"):
        resolve_colocated_resume(tmp_path, None)


def test_loading_the_last_checkpoint_keeps_the_final_evaluation_row(tmp_path: Path) -> None:
    # every batch (0, 1) sent, checkpoint 2 written, then the final policy 2 evaluated: nothing is redone
    save_checkpoint(tmp_path, 2, {}, {}, CheckpointConfig(interval=1))
    _write_rows(tmp_path / "metrics.jsonl", [0, 1])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "eval/reward": 0.1, "policy/version": 2}) + "\n")
    load_checkpoint(tmp_path, 2)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2]
