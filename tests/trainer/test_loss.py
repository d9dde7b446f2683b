"""The GRPO loss against hand-computed values: every mask, every tau, the closed-form gradient."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.config.trainer import LossConfig
from grpo.trainer.loss import grpo_loss


def _row(trainer: list[float], inference: list[float], adv: list[float], mask: list[bool], pos: list[int]):
    """Loss inputs of samples packed one after another; `pos` restarts at 0 per sample and becomes
    each token's sample id."""
    positions = torch.tensor(pos)
    return (
        torch.tensor(trainer, dtype=torch.float64, requires_grad=True),
        torch.tensor(inference, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask),
        torch.cumsum((positions == 0).long(), 0) - 1,
    )


def test_on_policy_loss_is_minus_advantage_weighted_logprob_sum_over_step_tokens():
    lp, inf, adv, mask, pos = _row(
        [0.0, -1.0, -2.0], [0.0, -1.0, -2.0], [0, 2.0, 2.0], [False, True, True], [0, 1, 2]
    )
    loss, sums = grpo_loss(lp, inf, adv, mask, pos, LossConfig(), loss_scale=4)
    assert loss.item() == pytest.approx(-(2.0 * -1.0 + 2.0 * -2.0) / 4)
    assert sums.num_loss_tokens == 2 and sums.num_masked_tokens == 0
    assert sums.kl_sum == pytest.approx(0.0)


def test_gradient_equals_minus_coeff_times_keep_over_loss_scale():
    cfg = LossConfig(kl_tau=0.3, adv_tau=0.7, token_mask_high=2.0)
    trainer = [0.0, -0.5, -1.0, -0.2, -3.0]
    inference = [0.0, -0.7, -1.0, -1.2, -3.1]  # token 3 has ratio e^1 > 2: masked
    adv = [0.0, 1.5, -1.0, 2.0, 0.5]
    mask = [False, True, True, True, False]
    lp, inf, a, m, pos = _row(trainer, inference, adv, mask, [0, 1, 2, 3, 4])
    loss, sums = grpo_loss(lp, inf, a, m, pos, cfg, loss_scale=10)
    loss.backward()
    expected = []
    for t in range(5):
        log_ratio = trainer[t] - inference[t]
        ratio = math.exp(log_ratio)
        keep = mask[t] and 0.125 <= ratio <= 2.0
        coeff = ratio * (0.7 * adv[t] - 0.3 * log_ratio)
        expected.append(-coeff * keep / 10)
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx(expected)
    assert sums.num_masked_tokens == 1


def test_teacher_term_compares_the_teacher_with_the_student_at_temperature_1():
    # Sampled at a temperature != 1, the student's tempered logprob (-2.0, what the ratio uses)
    # differs from its own distribution's (-1.5 at temperature 1, what the teacher is compared with).
    cfg = LossConfig(adv_tau=0.0, teacher_tau=0.5)
    lp, inf, adv, mask, pos = _row([0.0, -2.0], [0.0, -2.0], [0.0, 0.0], [False, True], [0, 1])
    teacher = torch.tensor([0.0, -1.0], dtype=torch.float64, requires_grad=True)
    untempered = torch.tensor([0.0, -1.5], dtype=torch.float64)
    loss, sums = grpo_loss(
        lp, inf, adv, mask, pos, cfg, loss_scale=1, teacher_lp=teacher, untempered_lp=untempered
    )
    loss.backward()
    # coeff = ratio 1 * 0.5 * (teacher -1 - student -1.5) = 0.25; the student's logprob is pushed up.
    assert lp.grad is not None and lp.grad[1].item() == pytest.approx(-0.25)
    assert teacher.grad is None
    r = math.exp(-1.0 - -1.5)
    assert sums.teacher_kl_sum == pytest.approx(r - 1 - 0.5)
    assert sums.metrics()["teacher_kl"] == pytest.approx(r - 1.5)


def test_teacher_tau_without_teacher_logprobs_is_a_user_error():
    lp, inf, adv, mask, pos = _row([0.0, -1.0], [0.0, -1.0], [0, 1.0], [False, True], [0, 1])
    with pytest.raises(ValueError, match="teacher_tau"):
        grpo_loss(lp, inf, adv, mask, pos, LossConfig(teacher_tau=1.0), loss_scale=1)


def test_no_gradient_reaches_inference_logprobs():
    lp, _, adv, mask, pos = _row([0.0, -1.0], [0.0, -1.2], [0, 1.0], [False, True], [0, 1])
    inf = torch.tensor([0.0, -1.2], dtype=torch.float64, requires_grad=True)
    loss, _ = grpo_loss(lp, inf, adv, mask, pos, LossConfig(kl_tau=1.0), loss_scale=1)
    loss.backward()
    assert inf.grad is None
    assert lp.grad is not None and lp.grad[1].item() != 0.0


def test_token_ratio_below_low_threshold_is_masked():
    lp, inf, adv, mask, pos = _row(
        [0.0, -5.0, -1.0], [0.0, -1.0, -1.0], [0, 1.0, 1.0], [False, True, True], [0, 1, 2]
    )
    cfg = LossConfig(geo_mask_low=0.0001)
    loss, sums = grpo_loss(lp, inf, adv, mask, pos, cfg, loss_scale=2)
    loss.backward()
    assert lp.grad is not None and lp.grad[1].item() == 0.0 and lp.grad[2].item() == pytest.approx(-0.5)
    assert sums.metrics()["masked"] == pytest.approx(0.5)


def test_geometric_mean_masks_the_whole_sample_but_not_its_neighbour():
    # sample 0 (positions 0..2): log ratios 1.5, 1.5 -> geo mean e^1.5 = 4.48 > geo_mask_high 4
    # sample 1 (positions 0..1): on-policy
    lp, inf, adv, mask, pos = _row(
        [0.0, -0.5, -0.5, 0.0, -1.0],
        [0.0, -2.0, -2.0, 0.0, -1.0],
        [0, 1, 1, 0, 1],
        [False, True, True, False, True],
        [0, 1, 2, 0, 1],
    )
    cfg = LossConfig(geo_mask_high=4.0)
    loss, sums = grpo_loss(lp, inf, adv, mask, pos, cfg, loss_scale=3)
    loss.backward()
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx([0, 0, 0, 0, -1 / 3])
    assert sums.num_masked_tokens == 2


def test_sequence_min_and_max_ratio_masks():
    # one token ratio e^-1 = 0.37 in sample 0 (< sequence_mask_low 0.5); one e^0.8 = 2.2 in sample 1 (> 2)
    lp, inf, adv, mask, pos = _row(
        [0.0, -2.0, -1.0, 0.0, -0.2, -1.0],
        [0.0, -1.0, -1.0, 0.0, -1.0, -1.0],
        [0, 1, 1, 0, 1, 1],
        [False, True, True, False, True, True],
        [0, 1, 2, 0, 1, 2],
    )
    low = LossConfig(sequence_mask_low=0.5)
    _, sums = grpo_loss(lp, inf, adv, mask, pos, low, loss_scale=4)
    assert sums.num_masked_tokens == 2
    high = LossConfig(sequence_mask_high=2.0)
    _, sums = grpo_loss(lp, inf, adv, mask, pos, high, loss_scale=4)
    assert sums.num_masked_tokens == 2
    both = LossConfig(sequence_mask_low=0.5, sequence_mask_high=2.0)
    _, sums = grpo_loss(lp, inf, adv, mask, pos, both, loss_scale=4)
    assert sums.num_masked_tokens == 4


def test_sequence_ratio_is_the_clipped_product_of_token_ratios_and_each_sample_is_averaged():
    # sample 0: log ratios 0.4 + 0.8 = 1.2 -> ratio e^1.2 = 3.32; sample 1: one token, log ratio -0.1
    lp, inf, adv, mask, pos = _row(
        [0.0, -1.0, -1.0, 0.0, -1.0],
        [0.0, -1.4, -1.8, 0.0, -0.9],
        [0, 1, 1, 0, 2],
        [False, True, True, False, True],
        [0, 1, 2, 0, 1],
    )
    loss, _ = grpo_loss(lp, inf, adv, mask, pos, LossConfig(ratio_type="sequence"), loss_scale=2)
    loss.backward()
    # each sample's tokens are divided by its own loss tokens (2 and 1), the step by its samples (2)
    expected = [0, -math.exp(1.2) / 2 / 2, -math.exp(1.2) / 2 / 2, 0, -math.exp(-0.1) * 2 / 1 / 2]
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx(expected)
    clipped = LossConfig(ratio_type="sequence", sequence_clip_high=1.5)
    lp.grad = None
    loss, _ = grpo_loss(lp, inf, adv, mask, pos, clipped, loss_scale=2)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0, -1.5 / 4, -1.5 / 4, 0, -math.exp(-0.1)])


def test_sequence_geometric_mean_ratio_is_the_clipped_mean_log_ratio_gspo():
    lp, inf, adv, mask, pos = _row(
        [0.0, -1.0, -1.0], [0.0, -1.4, -1.8], [0, 1, 1], [False, True, True], [0, 1, 2]
    )
    cfg = LossConfig(ratio_type="sequence_geometric_mean", sequence_clip_high=1.5)
    loss, _ = grpo_loss(lp, inf, adv, mask, pos, cfg, loss_scale=1)
    loss.backward()
    seq_ratio = min(math.exp((0.4 + 0.8) / 2), 1.5)  # e^0.6 = 1.82 -> clipped to 1.5
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx([0, -seq_ratio / 2, -seq_ratio / 2])
    lp.grad = None
    loss, _ = grpo_loss(
        lp, inf, adv, mask, pos, LossConfig(ratio_type="sequence_geometric_mean"), loss_scale=1
    )
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0, -math.exp(0.6) / 2, -math.exp(0.6) / 2])


def test_a_long_sequence_ratio_is_clipped_without_overflow():
    # 400 tokens of log ratio +0.5 each: e^200 overflows float32, the clip must come first
    n = 400
    lp = torch.full((n,), -1.0, dtype=torch.float32, requires_grad=True)
    inf = torch.full((n,), -1.5, dtype=torch.float32)
    cfg = LossConfig(ratio_type="sequence", token_mask_high=8.0, geo_mask_high=10.0, sequence_mask_high=100.0)
    loss, _ = grpo_loss(
        lp, inf, torch.ones(n), torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.long), cfg, 1
    )
    loss.backward()
    assert lp.grad is not None
    assert torch.allclose(lp.grad, torch.full((n,), -10.0 / n))


def test_the_step_normaliser_counts_samples_for_the_sequence_ratio_types():
    assert LossConfig(ratio_type="sequence").loss_scale(37, 5) == 5
    assert LossConfig(ratio_type="sequence_geometric_mean").loss_scale(37, 5) == 5
    assert LossConfig(ratio_type="sequence").loss_scale(0, 0) == 1
    with pytest.raises(ValueError, match="ratio_type: token"):
        LossConfig(ratio_type="sequence", normalization="constant", normalization_constant=64)


def test_a_masked_token_whose_ratio_overflows_leaves_the_metrics_finite_and_unchanged():
    # Sample 1 is one token with log ratio 200 (e^200 = inf in float32): masked, and the metrics
    # must be those of the batch without it (no inf in kl, no share in entropy or teacher_kl).
    def run(with_overflow: bool):
        trainer = [0.0, -1.0, -1.2, 0.0, -0.5]
        inference = [0.0, -1.3, -1.0, 0.0, -200.5]
        keep = 5 if with_overflow else 3
        lp = torch.tensor(trainer[:keep], requires_grad=True)
        entropy = torch.tensor([0.0, 1.0, 2.0, 0.0, 7.0][:keep])
        teacher = torch.tensor([0.0, -0.9, -1.1, 0.0, -9.0][:keep])
        mask = torch.tensor([False, True, True, False, True][:keep])
        sample_ids = torch.tensor([0, 0, 0, 1, 1][:keep])
        loss, sums = grpo_loss(
            lp,
            torch.tensor(inference[:keep]),
            torch.ones(keep),
            mask,
            sample_ids,
            LossConfig(teacher_tau=0.5),
            loss_scale=2,
            teacher_lp=teacher,
            entropy=entropy,
            untempered_lp=lp.detach(),
        )
        loss.backward()
        return loss, sums, lp.grad

    loss, sums, grad = run(with_overflow=True)
    clean_loss, clean_sums, clean_grad = run(with_overflow=False)
    metrics, clean = sums.metrics(), clean_sums.metrics()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    for key in ("loss", "mismatch_kl", "entropy", "teacher_kl"):
        assert metrics[key] == pytest.approx(clean[key]), key
    assert metrics["masked"] == pytest.approx(1 / 3) and clean["masked"] == 0.0
    assert loss.item() == pytest.approx(clean_loss.item())
    assert (
        grad is not None
        and clean_grad is not None
        and grad[:3].tolist() == pytest.approx(clean_grad.tolist())
    )
    assert grad[3:].tolist() == [0.0, 0.0]


def test_a_token_outside_the_truncated_kept_set_never_counts_even_with_token_mask_low_0():
    # Sample 2's one token was sampled by vLLM but the policy's top_p no longer keeps it: its
    # trainer logprob is the stand-in OUTSIDE_LOGPROB. With token_mask_low 0 no token mask drops it;
    # it must still leave the loss, its gradient and every metric as they are without it. (Its own
    # sample: the sequence masks see its true ratio, 0, and would drop its sample-mates too.)
    from grpo.trainer.sampling_truncation import OUTSIDE_LOGPROB

    def run(with_outside: bool):
        trainer = [0.0, -1.0, -1.2, 0.0, -0.4, OUTSIDE_LOGPROB]
        inference = [0.0, -1.3, -1.0, 0.0, -0.5, -2.0]
        keep = 6 if with_outside else 5
        lp = torch.tensor(trainer[:keep], requires_grad=True)
        loss, sums = grpo_loss(
            lp,
            torch.tensor(inference[:keep]),
            torch.ones(keep),
            torch.tensor([False, True, True, False, True, True][:keep]),
            torch.tensor([0, 0, 0, 1, 1, 2][:keep]),
            LossConfig(token_mask_low=0.0),
            loss_scale=4,
            entropy=torch.tensor([0.0, 1.0, 2.0, 0.0, 1.5, 3.0][:keep]),
        )
        loss.backward()
        return loss, sums.metrics(), lp.grad

    loss, metrics, grad = run(with_outside=True)
    clean_loss, clean, clean_grad = run(with_outside=False)
    assert loss.item() == pytest.approx(clean_loss.item())
    for key in ("loss", "mismatch_kl", "entropy"):
        assert metrics[key] == pytest.approx(clean[key]), key
    assert metrics["masked/truncated"] == pytest.approx(1 / 4) and clean["masked/truncated"] == 0.0
    assert metrics["masked"] == pytest.approx(1 / 4)
    assert grad is not None and clean_grad is not None
    assert grad[:5].tolist() == pytest.approx(clean_grad.tolist()) and grad[5].item() == 0.0


def test_kl_metric_is_k3_mean_over_kept_loss_tokens():
    lp, inf, adv, mask, pos = _row(
        [0.0, -1.0, -1.0], [0.0, -1.5, -0.5], [0, 0, 0], [False, True, True], [0, 1, 2]
    )
    _, sums = grpo_loss(lp, inf, adv, mask, pos, LossConfig(), loss_scale=2)
    k3 = [(math.exp(d) - 1 - d) for d in (0.5, -0.5)]
    assert sums.metrics()["mismatch_kl"] == pytest.approx(sum(k3) / 2)


def test_entropy_metric_is_mean_over_loss_tokens():
    lp, inf, adv, mask, pos = _row(
        [0.0, -1.0, -1.0], [0.0, -1.0, -1.0], [0, 0, 0], [False, True, True], [0, 1, 2]
    )
    entropy = torch.tensor([9.0, 1.0, 2.0])
    _, sums = grpo_loss(lp, inf, adv, mask, pos, LossConfig(), loss_scale=2, entropy=entropy)
    assert sums.metrics()["entropy"] == pytest.approx(1.5)


def test_masked_fractions_are_split_by_which_mask_dropped_the_tokens():
    # sample 0: token ratios e^-4 (< token_mask_low) and 1; sample 1: ratios e^0.8 = 2.2 (> sequence_mask_high
    # 2, so both its tokens go) and 1; sample 2: on-policy
    lp, inf, adv, mask, pos = _row(
        [0.0, -5.0, -1.0, 0.0, -0.2, -1.0, 0.0, -1.0],
        [0.0, -1.0, -1.0, 0.0, -1.0, -1.0, 0.0, -1.0],
        [0, 1, 1, 0, 1, 1, 0, 1],
        [False, True, True, False, True, True, False, True],
        [0, 1, 2, 0, 1, 2, 0, 1],
    )
    cfg = LossConfig(token_mask_low=0.1, sequence_mask_high=2.0, geo_mask_low=0.0001)
    _, sums = grpo_loss(lp, inf, adv, mask, pos, cfg, loss_scale=5)
    metrics = sums.metrics()
    assert metrics["masked"] == pytest.approx(3 / 5)
    assert metrics["masked/token_low"] == pytest.approx(1 / 5)
    assert metrics["masked/sequence_high"] == pytest.approx(2 / 5)
    assert metrics["masked/token_high"] == 0.0 and metrics["masked/sequence_low"] == 0.0


def test_each_turn_of_a_multi_turn_sample_is_weighted_by_its_own_advantage():
    # One sample: prompt, model turn 0 (advantage +1), an environment token, model turn 1 (advantage
    # -2), as the packer lays out per-turn credit. Tokens 2 and 5 have ratio e^0.5 > clip_high: PPO's
    # clip drops turn 0's (positive signal) and keeps turn 1's (negative signal).
    cfg = LossConfig(clip_high=1.28)
    trainer = [0.0, -1.0, -0.5, 0.0, -2.0, -0.5]
    inference = [0.0, -1.0, -1.0, 0.0, -2.0, -1.0]
    adv = [0.0, 1.0, 1.0, 0.0, -2.0, -2.0]
    mask = [False, True, True, False, True, True]
    lp, inf, a, m, pos = _row(trainer, inference, adv, mask, [0, 1, 2, 3, 4, 5])
    loss, sums = grpo_loss(lp, inf, a, m, pos, cfg, loss_scale=8)
    loss.backward()
    coeff = []
    for t in range(6):
        ratio = math.exp(trainer[t] - inference[t])
        has_gradient = mask[t] and not (ratio > 1.28 and adv[t] > 0)
        coeff.append(ratio * adv[t] if has_gradient else 0.0)
    assert coeff[2] == 0.0 and coeff[5] == pytest.approx(-2.0 * math.exp(0.5))
    assert loss.item() == pytest.approx(-sum(c * x for c, x in zip(coeff, trainer, strict=True)) / 8)
    assert lp.grad is not None
    assert lp.grad.tolist() == pytest.approx([-c / 8 for c in coeff])
    assert sums.num_clipped_high == 1
