"""Checkpoint format pieces that need no second rank: RNG states, a one-rank round trip of weights,
optimizer and schedule, and the padded row split that score() and training share."""

from __future__ import annotations

import json
import random

import numpy as np
import torch
from trainer_batches import default_rows, on_policy_batch

from grpo.trainer.checkpoint import STATE_FILE, rng_file, rng_state, set_rng_state
from grpo.trainer.distributed import balance_row_indices
from grpo.trainer.hf.checkpoint import load_checkpoint, read_optimizer_state
from grpo.trainer.hf.trainer import Trainer


def _draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_restored_rng_state_repeats_torch_numpy_and_python_draws():
    state = json.loads(json.dumps(rng_state()))  # it travels as JSON
    first = _draws()
    set_rng_state(state)
    assert _draws() == first


def test_padding_rows_get_indices_past_the_real_rows_and_every_rank_the_same_count():
    shares = balance_row_indices([40, 30, 20], 2)
    assert [len(s) for s in shares] == [2, 2]
    assert sorted(i for s in shares for i in s) == [0, 1, 2, 3]
    # The padding (index 3) goes with the smallest real row, next to the largest on the other rank.
    assert {frozenset(s) for s in shares} == {
        frozenset({0, 3}),
        frozenset({1, 2}),
    }


def test_one_rank_checkpoint_restores_weights_optimizer_schedule_and_step(make_cfg, tmp_path):
    cfg = make_cfg(output_dir=str(tmp_path), lr_scheduler_type="linear", max_steps=10)
    trainer = Trainer(cfg, tmp_path)
    trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
    folder = trainer.save_checkpoint()
    assert json.loads((folder / STATE_FILE).read_text()) == {"step": 1, "world_size": 1}
    assert (folder / rng_file(0)).exists() and not (folder / rng_file(1)).exists()
    # Nothing to unpickle on resume: every file is JSON, safetensors or the STABLE marker.
    for path in folder.iterdir():
        assert path.suffix in (".json", ".safetensors") or path.name == "STABLE", path.name
        assert not path.read_bytes().startswith((b"PK", b"\x80")), path.name  # torch.save zip / pickle
    # Optimizer state is keyed by parameter name, so any rank count (and FSDP2 sharding) can load it.
    saved_optimizer = read_optimizer_state(folder)
    names = [n for n, p in trainer.policy.model.named_parameters() if p.requires_grad]
    assert set(saved_optimizer["state"]) == set(names)

    fresh = Trainer(cfg, tmp_path / "fresh")
    assert load_checkpoint(folder, fresh.policy, fresh.optimizer, fresh.scheduler) == 1
    trained = dict(trainer.policy.model.named_parameters())
    for name, param in fresh.policy.model.named_parameters():
        assert torch.equal(param, trained[name]), name
    assert fresh.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()
    batch = on_policy_batch(trainer, 1, default_rows(seed=5))
    trainer.train_step(batch)
    fresh.train_step(batch)
    for name, param in fresh.policy.model.named_parameters():
        assert torch.equal(param, trained[name]), name  # same second step: the Adam moments came back
    trainer.close()
    fresh.close()
