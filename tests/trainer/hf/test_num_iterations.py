"""num_iterations: several optimizer updates per batch on the tiny model in float32, against two
updates written out by hand (the second against the first pass's logprobs as old logprobs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trainer_batches import default_rows, on_policy_batch

import grpo.trainer.hf.model as trainer_model
from grpo.config.trainer import LossConfig
from grpo.trainer.hf.trainer import Trainer
from grpo.trainer.logprobs import token_logprobs_and_untempered
from grpo.trainer.loss import loss_of_tokens
from grpo.trainer.optim import clip_gradients
from grpo.transport.batches.batch import TrainingBatch


@pytest.fixture
def float32(monkeypatch):
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)


def _trainer(make_cfg, path, **overrides) -> Trainer:
    trainer = Trainer(make_cfg(**overrides), path)
    torch.manual_seed(0)
    for name, param in trainer.policy.model.named_parameters():
        if "lora_B" in name:  # B = 0 would leave A without a gradient on the first update
            torch.nn.init.normal_(param, std=0.05)
    return trainer


def _off_policy_batch(trainer: Trainer) -> TrainingBatch:
    """The trainer's own logprobs, moved by up to +-0.02: vLLM's mu differs from pi_old, so a rule
    that confused them would clip other tokens."""
    batch = on_policy_batch(trainer, 0, default_rows())
    rng = np.random.default_rng(3)
    for row in batch.rows:
        noise = rng.uniform(-0.02, 0.02, row.inference_logprobs.shape).astype(np.float32)
        row.inference_logprobs = np.where(row.loss_mask, row.inference_logprobs + noise, 0.0).astype(
            np.float32
        )
    return batch


def test_two_iterations_equal_two_manual_updates_with_the_first_pass_logprobs_as_old(
    make_cfg, tmp_path, float32
):
    # A tight clip (and tis_cap) so that which ratio each update tests changes which tokens keep a gradient.
    knobs = {"loss": LossConfig(clip_low=0.99, clip_high=1.01, tis_cap=1.005), "learning_rate": 2e-2}
    ours = _trainer(make_cfg, tmp_path / "a", num_iterations=2, **knobs)
    by_hand = _trainer(make_cfg, tmp_path / "b", **knobs)
    batch = _off_policy_batch(ours)
    metrics = ours.train_step(batch)

    cfg = by_hand.cfg
    micro_batches = by_hand._micro_batches(batch.rows)
    loss_scale = batch.num_loss_tokens
    old: list[torch.Tensor] = []
    for update in range(2):
        by_hand.optimizer.zero_grad(set_to_none=True)
        clipped = 0
        for index, mb in enumerate(micro_batches):
            hidden = by_hand.policy.hidden_states(mb)
            tokens = mb.loss
            # Probabilities kept for backward, as the trainer keeps them where they fit (on the tiny
            # model always): the tight clip below turns the recompute's rounding into other updates.
            lp, entropy, _ = token_logprobs_and_untempered(
                hidden[tokens.predicted_from],
                by_hand.policy.lm_head,
                tokens.targets,
                tokens.temperatures,
                16,
                untempered=False,
                keep_probs=True,
            )
            if update == 0:
                old.append(lp.detach())
            loss, sums = loss_of_tokens(
                tokens, lp, entropy, None, cfg.loss, loss_scale, old_lp=old[index] if update else None
            )
            loss.backward()
            clipped += sums.num_clipped_low + sums.num_clipped_high
        clip_gradients(by_hand.params, cfg.max_grad_norm)
        by_hand.optimizer.step()

    for got, want in zip(ours.params, by_hand.params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The metrics are the second update's: its clip acted (against pi_old), as by hand.
    assert metrics["clip_frac_low"] + metrics["clip_frac_high"] == pytest.approx(clipped / loss_scale)
    assert clipped > 0
    # One step, one batch: the schedule and the step count moved once.
    assert ours.num_steps_done == 1 and ours.scheduler.last_epoch == 1
    for cleanup in (ours, by_hand):
        cleanup.close()


def test_a_second_iteration_changes_the_update(make_cfg, tmp_path, float32):
    one = _trainer(make_cfg, tmp_path / "a")
    two = _trainer(make_cfg, tmp_path / "b", num_iterations=2)
    batch = _off_policy_batch(one)
    one.train_step(batch)
    two.train_step(batch)
    assert any(not torch.allclose(p, q) for p, q in zip(one.params, two.params, strict=True))
    for cleanup in (one, two):
        cleanup.close()
