"""How a step's rows are grouped (micro-batches, backward groups) never changes its gradient."""

from __future__ import annotations

import torch
from trainer_batches import distributed_test_batch

from grpo.trainer.hf import model as trainer_model
from grpo.trainer.hf.trainer import Trainer
from grpo.trainer.packing import split_micro_batches


def _step_gradients(make_cfg, tmp_path, **overrides) -> dict[str, torch.Tensor]:
    trainer = Trainer(
        make_cfg(max_grad_norm=0.0, loss={"token_mask_low": 0.0, "geo_mask_low": 0.0}, **overrides), tmp_path
    )
    trainer.train_step(distributed_test_batch())
    grads = {n: p.grad.float().clone() for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
    trainer.close()
    return grads


def test_groups_are_consecutive_and_keep_the_remainder():
    assert split_micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_gradient_does_not_depend_on_accumulation_or_micro_batch_size(make_cfg, tmp_path, monkeypatch):
    # float32: grouping changes how pieces are padded together, and bf16 rounds each shape its own way.
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)
    # micro_batch_tokens 1: every row a micro-batch of its own.
    reference = _step_gradients(make_cfg, tmp_path / "a", micro_batch_tokens=1, micro_batches_per_backward=1)
    grouped = _step_gradients(make_cfg, tmp_path / "b", micro_batch_tokens=1, micro_batches_per_backward=3)
    # Every row in one micro-batch: padded side by side in decoder calls (grpo.trainer.packing).
    wide = _step_gradients(make_cfg, tmp_path / "c", micro_batch_tokens=100_000, micro_batches_per_backward=2)
    assert any(float(g.abs().max()) > 0 for g in reference.values())
    for name, grad in reference.items():
        scale = float(grad.abs().max()) + 1e-12
        assert torch.allclose(grouped[name], grad, atol=1e-5 * scale), name
        assert torch.allclose(wide[name], grad, atol=1e-5 * scale), name
