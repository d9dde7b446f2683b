"""The frozen reference of loss.kl_beta on the tiny model, in float32: LoRA's is the base model
exactly (adapters disabled), full training's a frozen copy of the initial weights, shared-prefix
rows score like plain rows, and the KL term's gradient in a step equals a direct computation
against a separately built reference (a trainer whose LoRA is still zero)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_shared_prefix import random_rollouts
from trainer_batches import default_rows, on_policy_batch, reference_logprobs

import grpo.trainer.hf.model as trainer_model
from grpo.config.trainer import LossConfig
from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.trainer.hf.trainer import Trainer
from grpo.trainer.logprobs import token_logprobs
from grpo.trainer.ref_kl import kl_estimate


@pytest.fixture
def float32(monkeypatch):
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)


def _trainer(make_cfg, path, lora_b_std: float = 0.0, **overrides) -> Trainer:
    # micro_batch_tokens 1: a micro-batch per row, so rows and micro-batches pair up one to one
    trainer = Trainer(make_cfg(micro_batch_tokens=1, **overrides), path)
    if lora_b_std > 0:  # a trained-looking adapter: the policy is no longer the base
        torch.manual_seed(0)
        for name, param in trainer.policy.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=lora_b_std)
    return trainer


def _policy_logprobs(trainer: Trainer, mb) -> torch.Tensor:
    """The policy's logprobs of a micro-batch's loss tokens, computed as a training step does."""
    hidden = trainer.policy.hidden_states(mb)
    tokens = mb.loss
    lp, _ = token_logprobs(
        hidden[tokens.predicted_from], trainer.policy.lm_head, tokens.targets, tokens.temperatures, 16
    )
    return lp


def test_the_lora_reference_is_the_base_model_exactly(make_cfg, tmp_path, tiny_model_path, float32):
    trained = _trainer(make_cfg, tmp_path / "a", lora_b_std=0.05, loss=LossConfig(kl_beta=0.1))
    base = _trainer(make_cfg, tmp_path / "b")  # LoRA B = 0: the policy is the base model
    rows = default_rows()
    plain = reference_logprobs(tiny_model_path, rows)
    for row, mb, base_mb, plain_lp in zip(
        rows, trained._micro_batches(rows), base._micro_batches(rows), plain, strict=True
    ):
        ref = trained.reference.token_logprobs(mb, 16)
        with torch.no_grad():
            assert torch.equal(ref, _policy_logprobs(base, base_mb))
            assert not torch.allclose(ref, _policy_logprobs(trained, mb), atol=1e-3)
        np.testing.assert_allclose(ref.cpu().numpy(), plain_lp[row.loss_mask], atol=1e-4)
    for cleanup in (trained, base):
        cleanup.close()


def test_the_full_weight_reference_is_a_frozen_copy_of_the_initial_weights(make_cfg, tmp_path, float32):
    trainer = _trainer(make_cfg, tmp_path, lora=False, learning_rate=1e-3, loss=LossConfig(kl_beta=0.1))
    rows = default_rows()
    (mb, *_) = trainer._micro_batches(rows)
    ref_before = trainer.reference.token_logprobs(mb, 16)
    with torch.no_grad():
        assert torch.equal(ref_before, _policy_logprobs(trainer, mb))
    metrics = trainer.train_step(on_policy_batch(trainer, 0, rows))
    assert metrics["kl_ref"] == 0.0  # the first step's policy is the reference
    with torch.no_grad():
        assert torch.equal(trainer.reference.token_logprobs(mb, 16), ref_before)
        assert not torch.allclose(_policy_logprobs(trainer, mb), ref_before, atol=1e-4)
    assert not any(p.requires_grad for p in trainer.reference._copy.model.parameters())
    trainer.close()


def test_the_reference_scores_shared_prefix_rows_like_plain_rows(make_cfg, tmp_path, float32):
    trainer = _trainer(
        make_cfg, tmp_path, lora_b_std=0.05, loss=LossConfig(kl_beta=0.1), logprob_chunk_size=7
    )
    rollouts = random_rollouts(4, multi_turn=True)
    by_layout = []
    for share in (False, True):
        rows, _ = pack_rollouts(rollouts, 512, share_prefixes=share)
        values = {}
        for mb in trainer._micro_batches(rows):
            ref = trainer.reference.token_logprobs(mb, 7)
            for key, value in zip(mb.loss.inference_logprobs.tolist(), ref.tolist(), strict=True):
                values[key] = value  # each loss token has its own inference logprob
        by_layout.append(values)
    plain, shared = by_layout
    assert plain.keys() == shared.keys() and len(plain) > 20
    assert [shared[k] for k in plain] == pytest.approx(list(plain.values()), abs=1e-5)
    trainer.close()


def test_the_kl_gradient_of_a_step_equals_a_direct_computation_against_a_separate_reference(
    make_cfg, tmp_path, float32
):
    beta, estimator = 0.5, "k3"  # (every estimator's formula: tests/trainer/test_ref_kl.py)
    # adv_tau 0: the kl_beta term is the whole loss.
    loss = LossConfig(adv_tau=0.0, kl_beta=beta, kl_estimator=estimator)
    trainer = _trainer(make_cfg, tmp_path / "a", lora_b_std=0.05, loss=loss)
    separate_reference = _trainer(make_cfg, tmp_path / "b")
    rows = default_rows()
    batch = on_policy_batch(trainer, 0, rows)  # inference = policy: nothing masked
    num_loss_tokens = sum(r.num_loss_tokens for r in rows)

    trainer.begin_step(0, num_loss_tokens)
    trainer.accumulate(batch)
    params = trainer.params
    ours = [p.grad.clone() for p in params]

    direct = torch.zeros((), dtype=torch.float32)
    kl_sum = 0.0
    for row, mb, ref_scored in zip(
        rows, trainer._micro_batches(rows), separate_reference.score(rows), strict=True
    ):
        ref = torch.from_numpy(ref_scored[row.loss_mask])
        per_token = kl_estimate(_policy_logprobs(trainer, mb).cpu(), ref, estimator)  # CUDA too
        direct = direct + beta * per_token.sum() / num_loss_tokens
        kl_sum += float(per_token.detach().sum())
    expected = torch.autograd.grad(direct, params)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert any(g.abs().max() > 0 for g in ours)
    metrics = trainer.finish_step()
    assert metrics["kl_ref"] == pytest.approx(kl_sum / num_loss_tokens, rel=1e-4)
    for cleanup in (trainer, separate_reference):
        cleanup.close()


def test_with_the_policy_still_the_reference_the_kl_term_is_zero_with_no_gradient(
    make_cfg, tmp_path, float32
):
    trainer = _trainer(make_cfg, tmp_path, loss=LossConfig(adv_tau=0.0, kl_beta=1.0))  # LoRA B = 0
    metrics = trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
    assert metrics["kl_ref"] == 0.0
    assert metrics["grad_norm_before_clip"] == 0.0
    trainer.close()


def _descendants_or_self(parent_ids: np.ndarray) -> np.ndarray:
    """[T, T] bool: entry [t, u] is true where u is t or follows it in u's sequence (t an ancestor)."""
    num_tokens = len(parent_ids)
    below = np.eye(num_tokens, dtype=bool)
    for u in range(num_tokens):
        t = int(parent_ids[u])
        while t >= 0:
            below[t, u] = True
            t = int(parent_ids[t])
    return below


def test_the_kl_in_reward_gradient_of_a_step_equals_a_direct_return_to_go_on_shared_prefix_rows(
    make_cfg, tmp_path, float32
):
    beta, estimator = 0.5, "k1"
    loss = LossConfig(kl_beta=beta, kl_estimator=estimator, kl_in_reward=True)
    trainer = _trainer(make_cfg, tmp_path / "a", lora_b_std=0.05, loss=loss)
    separate_reference = _trainer(make_cfg, tmp_path / "b")
    rollouts = random_rollouts(5, multi_turn=True)
    for i, rollout in enumerate(rollouts):
        rollout.advantage = float(i % 3) - 1.0
    rows, _ = pack_rollouts(rollouts, 512, share_prefixes=True)
    assert any(len(np.unique(r.parent_ids[r.parent_ids >= 0])) < r.num_tokens - 1 for r in rows)  # trees
    batch = on_policy_batch(trainer, 0, rows)  # inference = policy: ratio 1, nothing masked
    num_loss_tokens = sum(r.num_loss_tokens for r in rows)

    trainer.begin_step(0, num_loss_tokens)
    trainer.accumulate(batch)
    params = trainer.params
    ours = [p.grad.clone() for p in params]

    # Direct: a loss token's penalty is the KL of the loss tokens that follow it in its own sample
    # (its descendants in the tree, itself included), found by walking parents.
    direct = torch.zeros((), dtype=torch.float32)
    for row, mb, ref_scored in zip(
        rows, trainer._micro_batches(rows), separate_reference.score(rows), strict=True
    ):
        lp = _policy_logprobs(trainer, mb).cpu()  # the direct side on the CPU, the trainer's anywhere
        kl = kl_estimate(lp.detach(), torch.from_numpy(ref_scored[row.loss_mask]), estimator)
        loss_positions = np.flatnonzero(row.loss_mask)
        below = _descendants_or_self(row.parent_ids)[np.ix_(loss_positions, loss_positions)]
        to_go = torch.from_numpy(below.astype(np.float32)) @ kl
        advantage = torch.from_numpy(row.advantages[row.loss_mask]) - beta * to_go
        ratio = torch.exp(lp.detach() - torch.from_numpy(row.inference_logprobs[row.loss_mask]))
        direct = direct - (ratio * advantage * lp).sum() / num_loss_tokens
    expected = torch.autograd.grad(direct, params)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert any(g.abs().max() > 0 for g in ours)
    trainer.finish_step()
    for cleanup in (trainer, separate_reference):
        cleanup.close()
