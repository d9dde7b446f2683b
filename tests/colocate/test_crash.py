"""The message a co-located run prints when its engine dies: where it resumes, and the command."""

from __future__ import annotations

from pathlib import Path

from grpo.colocate.crash import engine_crash_message, resume_command
from grpo.utils.atomic import write_json_atomic


def checkpoint(folder: Path) -> None:
    write_json_atomic(folder / "state.json", {})
    (folder / "STABLE").touch()


def test_the_resume_command_repeats_the_arguments_with_resume_step_minus_one_from_the_same_folder() -> None:
    argv = [
        "/venv/bin/grpo",
        "--train",
        "t.yaml",
        "--infer",
        "my infer.yaml",
        "--orch",
        "o.yaml",
        "--orch.lr",
        "1",
    ]
    assert resume_command(argv, "/runs") == (
        "cd /runs && grpo --train t.yaml --infer 'my infer.yaml' --orch o.yaml --orch.lr 1 "
        "--train.ckpt.resume_step -1"
    )


def test_a_resumed_run_that_crashes_again_gets_one_resume_override_not_two() -> None:
    argv = ["grpo", "--train", "t.yaml", "--train.ckpt.resume_step", "-1", "--orch.ckpt.resume_step=3"]
    assert resume_command(argv, "/r") == "cd /r && grpo --train t.yaml --train.ckpt.resume_step -1"


def test_the_message_names_the_newest_step_both_sides_checkpointed(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        checkpoint(tmp_path / "checkpoints" / "trainer" / f"step_{step}")
    for step in (2, 3, 4):  # the orchestrator's run ahead
        checkpoint(tmp_path / "checkpoints" / "orchestrator" / f"step_{step}")
    message = engine_crash_message(tmp_path, "the inference server stopped", ["grpo", "--train", "t.yaml"])
    assert "the inference engine died (the inference server stopped)" in message
    assert "from step 3," in message
    assert message.splitlines()[-1].strip().endswith("grpo --train t.yaml --train.ckpt.resume_step -1")


def test_without_a_checkpoint_on_both_sides_the_message_says_the_run_restarts_at_step_0(
    tmp_path: Path,
) -> None:
    checkpoint(tmp_path / "checkpoints" / "orchestrator" / "step_1")
    message = engine_crash_message(tmp_path, "gone", ["grpo"])
    assert "from step 0: no step" in message and "ckpt.interval" in message
