"""Multi-rank checkpoints: a 2-rank run stopped after step 2 and resumed on 2 fresh ranks ends where
an uninterrupted 2-rank run ends; its checkpoints resume on one rank; score() on 2 ranks equals
score() on one rank of the same weights. LoRA (replicated, data parallel) and full weights (FSDP2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_worker import NUM_STEPS, STOP_AT, launch, run_batch, run_cfg
from safetensors.torch import load_file
from trainer_batches import distributed_test_batch

from grpo.trainer.checkpoint import STATE_FILE, checkpoint_dir, complete_checkpoints, rng_file
from grpo.trainer.hf.checkpoint import TRAINABLE_FILE, load_checkpoint, read_optimizer_state
from grpo.trainer.hf.trainer import Trainer
from grpo.utils.atomic import is_stable
from grpo.utils.jsonl import read_jsonl

pytestmark = pytest.mark.slow


MODES = ("lora", "full")


@pytest.fixture(scope="module")
def two_rank_runs_of_both_modes(tiny_model_path, tmp_path_factory) -> Path:
    """OUT_DIR of dist_worker's `train` then `resume` scenarios (two separate torchrun launches), each
    launch taking both modes in turn (OUT_DIR/lora, OUT_DIR/full): a torchrun start-up costs more
    here than the tiny model's steps."""
    out_dir = tmp_path_factory.mktemp("two_rank")
    launch("train", tiny_model_path, out_dir, ",".join(MODES))
    for mode in MODES:
        assert sorted(complete_checkpoints(out_dir / mode / "split")) == [STOP_AT], (
            f"the split {mode} run must stop at step 2"
        )
    launch("resume", tiny_model_path, out_dir, ",".join(MODES))
    return out_dir


@pytest.fixture(scope="module", params=MODES)
def two_rank_runs(request, two_rank_runs_of_both_modes) -> tuple[Path, str]:
    """OUT_DIR of one mode's 2-rank runs, and the mode."""
    mode = request.param
    return two_rank_runs_of_both_modes / mode, mode


def _single_rank_trainer(model_path: Path, run_dir: Path, mode: str) -> Trainer:
    cfg = run_cfg(str(model_path), run_dir, mode, resume=False)
    return Trainer(cfg, run_dir)


def _assert_same_tree(got: object, want: object, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_same_tree(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same_tree(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_resumed_two_rank_run_ends_with_the_state_of_an_uninterrupted_run(two_rank_runs):
    out_dir, _mode = two_rank_runs
    resumed = checkpoint_dir(out_dir / "split", NUM_STEPS)
    uninterrupted = checkpoint_dir(out_dir / "whole", NUM_STEPS)
    assert is_stable(resumed) and is_stable(uninterrupted)
    resumed_params = load_file(str(resumed / TRAINABLE_FILE))
    start_params = load_file(str(checkpoint_dir(out_dir / "split", STOP_AT) / TRAINABLE_FILE))
    # Same steps 3..4 on the same 2-rank split: the same floating-point operations, so equal bits.
    _assert_same_tree(resumed_params, load_file(str(uninterrupted / TRAINABLE_FILE)), "params")
    assert any(not torch.equal(resumed_params[n], start_params[n]) for n in start_params), (
        "steps 3..4 trained"
    )
    _assert_same_tree(
        read_optimizer_state(resumed),
        read_optimizer_state(uninterrupted),
        "optimizer",
    )
    resumed_metrics = read_jsonl(out_dir / "split" / "trainer_metrics.jsonl")
    whole_metrics = read_jsonl(out_dir / "whole" / "trainer_metrics.jsonl")
    assert [r["step"] for r in resumed_metrics] == list(range(NUM_STEPS))  # no gap, no repeat
    assert [r["loss"] for r in resumed_metrics] == [r["loss"] for r in whole_metrics]


def test_every_rank_leaves_its_rng_state_and_rank_zero_the_step(two_rank_runs):
    out_dir, _mode = two_rank_runs
    folder = checkpoint_dir(out_dir / "split", STOP_AT)
    assert (folder / rng_file(0)).exists() and (folder / rng_file(1)).exists()
    assert not (folder / rng_file(2)).exists()
    assert json.loads((folder / STATE_FILE).read_text()) == {"step": STOP_AT, "world_size": 2}


def test_two_rank_run_publishes_whole_weights_after_each_step(two_rank_runs):
    out_dir, mode = two_rank_runs
    published = out_dir / "split" / "broadcasts" / f"step_{NUM_STEPS}"
    assert is_stable(published)
    if mode == "lora":
        assert (published / "adapter_model.safetensors").exists()
        return
    # FSDP2 shards every decoder layer over the ranks; the published model must be whole.
    weights = load_file(str(published / "model.safetensors"))
    checkpointed = load_file(str(checkpoint_dir(out_dir / "split", NUM_STEPS) / TRAINABLE_FILE))
    assert set(weights) == set(checkpointed)
    for name, tensor in checkpointed.items():
        assert torch.equal(weights[name], tensor), name


def test_one_rank_resumes_a_two_rank_checkpoint(two_rank_runs, tiny_model_path, tmp_path):
    out_dir, mode = two_rank_runs
    folder = checkpoint_dir(out_dir / "split", STOP_AT)
    trainer = _single_rank_trainer(tiny_model_path, tmp_path, mode)
    assert load_checkpoint(folder, trainer.policy, trainer.optimizer, trainer.scheduler) == STOP_AT
    saved = load_file(str(folder / TRAINABLE_FILE))
    for name, param in trainer.policy.model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.detach(), saved[name]), name
    saved_optimizer = read_optimizer_state(folder)["state"]
    names = [n for n, p in trainer.policy.model.named_parameters() if p.requires_grad]
    for index, name in enumerate(names):
        state = trainer.optimizer.state_dict()["state"][index]
        assert torch.equal(state["exp_avg_sq"], saved_optimizer[name]["exp_avg_sq"]), name
    assert trainer.scheduler.last_epoch == STOP_AT
    # The loss is computed before the update: the same weights give the 2-rank run's step-2 loss.
    metrics = trainer.train_step(run_batch(STOP_AT))
    two_rank_loss = read_jsonl(out_dir / "whole" / "trainer_metrics.jsonl")[STOP_AT]["loss"]
    assert metrics["loss"] == pytest.approx(two_rank_loss, rel=1e-4, abs=1e-7)
    trainer.close()


def test_two_rank_score_equals_one_rank_score_of_the_same_weights(two_rank_runs, tiny_model_path, tmp_path):
    out_dir, mode = two_rank_runs
    trainer = _single_rank_trainer(tiny_model_path, tmp_path, mode)
    rows = distributed_test_batch().rows
    untrained = trainer.score(rows)
    load_checkpoint(
        checkpoint_dir(out_dir / "whole", NUM_STEPS), trainer.policy, trainer.optimizer, trainer.scheduler
    )
    expected = trainer.score(rows)
    assert any(not np.allclose(a, b, atol=1e-5) for a, b in zip(untrained, expected, strict=True)), "trained"
    for name in ("score", "score_shared"):
        for rank in (0, 1):  # every rank gets every row's logprobs
            got = load_file(str(out_dir / f"{name}_rank{rank}.safetensors"))
            assert len(got) == len(rows)
            for i, want in enumerate(expected):
                assert got[f"row{i}"].shape == want.shape
                np.testing.assert_allclose(
                    got[f"row{i}"].numpy(), want, atol=1e-5, rtol=0, err_msg=f"{name}{i}"
                )
    trainer.close()
