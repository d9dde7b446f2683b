"""Shared-prefix rows train exactly like plain rows: same logprobs, same gradient, same loss sums.

Random groups with varied prompt and completion lengths, multi-turn rollouts (environment tokens
between model turns), several temperatures, masked rollouts, identical completions within a group
(their loss tokens must not merge) and a prompt shared by two groups; masks of the loss triggered
or wide open. Both layouts come from the orchestrator's own packer, so this covers the whole path
from rollouts to gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import grpo.trainer.hf.model as trainer_model
from grpo.config.trainer import LossConfig
from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.types import Rollout
from grpo.trainer.hf.trainer import Trainer
from grpo.trainer.loss import LossSums
from grpo.transport.batches.batch import PackedRow, SamplingTruncation

VOCAB = 500


def random_rollouts(
    seed: int, num_groups: int = 3, group_size: int = 4, multi_turn: bool = False
) -> list[Rollout]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(3, 14))).tolist() for _ in range(num_groups)]
    prompts[-1] = prompts[0]  # two groups of the same example share one tree
    rollouts = []
    previous_completion: list[int] = []
    for group, prompt in enumerate(prompts):
        temperature = float(rng.choice([0.6, 1.0, 1.4]))
        for k in range(group_size):
            ids = rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist()
            if k == 2:
                ids = list(previous_completion)  # the same answer twice: same ids, other values
            mask = [True] * len(ids)
            if multi_turn:
                env_reply = rng.integers(0, VOCAB, int(rng.integers(1, 4))).tolist()
                second_turn = rng.integers(0, VOCAB, int(rng.integers(1, 5))).tolist()
                ids += env_reply + second_turn
                mask += [False] * len(env_reply) + [True] * len(second_turn)
            previous_completion = ids
            rollouts.append(
                Rollout(
                    env_name="e",
                    example_index=group,
                    prompt_ids=list(prompt),
                    completion_ids=ids,
                    completion_mask=mask,
                    # Distinct per token (they name each loss token across layouts), near the tiny
                    # random model's own (about -10.8) so that the default masks keep some tokens.
                    completion_logprobs=[float(-rng.uniform(8.0, 14.0)) if m else 0.0 for m in mask],
                    temperature=temperature,
                    start_version=0,
                    end_version=0,
                    advantage=float(rng.normal()),
                    masked=bool(k == 3 and group == 1),
                )
            )
    return rollouts


def _float32_trainer(
    make_cfg, tmp_path, monkeypatch, lora: bool, loss: LossConfig, rows_per_micro_batch: int
):
    # float32 end to end: bf16 matmuls of other shapes round differently, which is not the point here.
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)
    trainer = Trainer(
        make_cfg(lora=lora, loss=loss, micro_batch_tokens=rows_per_micro_batch * 1024, logprob_chunk_size=7),
        tmp_path,
    )
    if lora:  # B starts at zero, which would make every gradient of A zero
        torch.manual_seed(0)
        for name, param in trainer.policy.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
    return trainer


def _gradients(trainer: Trainer, rows: list[PackedRow]) -> tuple[dict[str, torch.Tensor], LossSums]:
    """The step's gradient and loss sums, computed as train_step does (without the update)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    loss_scale = sum(r.num_loss_tokens for r in rows)
    totals = LossSums()
    for mb in trainer._micro_batches(rows):
        loss, sums, _ = trainer._micro_batch_loss(mb, loss_scale, SamplingTruncation())
        loss.backward()
        totals.add(sums)
    grads = {n: p.grad.clone() for n, p in trainer.policy.model.named_parameters() if p.grad is not None}
    return grads, totals


def _loss_token_logprobs(trainer: Trainer, rows: list[PackedRow]) -> dict[float, float]:
    """Trainer logprob of every loss token, keyed by its (unique) inference logprob."""
    out = {}
    for row, logprobs in zip(rows, trainer.score(rows), strict=True):
        for key, value in zip(row.inference_logprobs[row.loss_mask], logprobs[row.loss_mask], strict=True):
            out[float(key)] = float(value)
    return out


@pytest.mark.parametrize(
    ("seed", "lora", "multi_turn", "seq_len", "rows_per_micro_batch", "loss"),
    [
        (0, True, False, 512, 1, LossConfig()),
        (1, False, True, 512, 2, LossConfig()),
        (2, True, True, 40, 1, LossConfig(ratio_type="sequence")),
        (
            3,
            False,
            False,
            64,
            3,
            LossConfig(token_mask_low=0.0, token_mask_high=1e9, geo_mask_low=0.0, geo_mask_high=1e9),
        ),
    ],
    ids=["lora", "full-multi-turn", "lora-multi-turn-split-trees-sequence-ratio", "full-open-masks"],
)
def test_shared_prefix_rows_give_the_logprobs_gradient_and_loss_of_plain_rows(
    make_cfg, tmp_path, monkeypatch, seed, lora, multi_turn, seq_len, rows_per_micro_batch, loss
):
    rollouts = random_rollouts(seed, multi_turn=multi_turn)
    plain, plain_stats = pack_rollouts(rollouts, seq_len, share_prefixes=False)
    shared, shared_stats = pack_rollouts(rollouts, seq_len, share_prefixes=True)
    assert shared_stats.num_tokens < plain_stats.num_tokens  # something was shared
    assert shared_stats.num_sample_tokens == plain_stats.num_sample_tokens == plain_stats.num_tokens
    assert sum(r.num_loss_tokens for r in shared) == sum(r.num_loss_tokens for r in plain)
    assert sum(len(r.sequence_lengths()) for r in shared) == len(rollouts)
    assert sorted(n for r in shared for n in r.sequence_lengths()) == sorted(
        n for r in plain for n in r.sequence_lengths()
    )

    trainer = _float32_trainer(make_cfg, tmp_path, monkeypatch, lora, loss, rows_per_micro_batch)
    plain_lp, shared_lp = _loss_token_logprobs(trainer, plain), _loss_token_logprobs(trainer, shared)
    assert len(plain_lp) == sum(r.num_loss_tokens for r in plain) and plain_lp.keys() == shared_lp.keys()
    np.testing.assert_allclose([shared_lp[k] for k in plain_lp], list(plain_lp.values()), atol=2e-5, rtol=0)

    plain_grads, plain_sums = _gradients(trainer, plain)
    shared_grads, shared_sums = _gradients(trainer, shared)
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    assert max(float(g.abs().max()) for g in plain_grads.values()) > 1e-4  # a real gradient
    for name, grad in plain_grads.items():
        # float32 sums in another order: differences around 1e-7 of the largest entry
        scale = float(grad.abs().max())
        torch.testing.assert_close(
            shared_grads[name], grad, atol=1e-5 * scale, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert shared_sums.num_loss_tokens == plain_sums.num_loss_tokens
    assert shared_sums.num_masked_tokens == plain_sums.num_masked_tokens
    assert shared_sums.loss == pytest.approx(plain_sums.loss, abs=1e-5)
    assert shared_sums.kl_sum == pytest.approx(plain_sums.kl_sum, rel=1e-4)
    assert shared_sums.entropy_sum == pytest.approx(plain_sums.entropy_sum, rel=1e-5)
    trainer.close()


def test_masks_of_the_default_loss_are_triggered_by_the_random_batches(make_cfg, tmp_path, monkeypatch):
    """The equivalence above covers masked tokens: the default masks do drop some of these tokens."""
    rollouts = random_rollouts(0)
    shared, _ = pack_rollouts(rollouts, 512, share_prefixes=True)
    trainer = _float32_trainer(make_cfg, tmp_path, monkeypatch, True, LossConfig(), 1)
    _, sums = _gradients(trainer, shared)
    assert 0 < sums.num_masked_tokens < sums.num_loss_tokens
    trainer.close()


def test_a_training_step_on_shared_rows_reports_whole_sequence_tokens(make_cfg, tmp_path):
    from grpo.transport.batches.batch import TrainingBatch

    rollouts = random_rollouts(4)
    shared, stats = pack_rollouts(rollouts, 512, share_prefixes=True)
    trainer = Trainer(make_cfg(), tmp_path)
    metrics = trainer.train_step(TrainingBatch(step=0, rows=shared))
    assert metrics["sequence_tokens_per_s"] / metrics["tokens_per_s"] == pytest.approx(
        stats.num_sample_tokens / stats.num_tokens
    )
    trainer.close()


@pytest.mark.parametrize("seq_len", [40, 512])
@pytest.mark.parametrize("share_prefixes", [False, True])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_a_row_counts_the_samples_that_the_loss_tells_apart(multi_turn, share_prefixes, seq_len):
    """The per-sample normaliser (PackedRow.num_loss_samples) counts the sample groups the loss
    sees (LossTokens.sequence_ids): one per trained rollout, whatever the layout."""
    from grpo.trainer.packing import build_micro_batch

    rollouts = random_rollouts(1, multi_turn=multi_turn)
    rows, _ = pack_rollouts(rollouts, seq_len, share_prefixes=share_prefixes)
    for row in rows:
        tokens = build_micro_batch([row], torch.device("cpu"), varlen_attention=False).loss
        assert row.num_loss_samples == len(torch.unique(tokens.sequence_ids))
    assert sum(r.num_loss_samples for r in rows) == sum(not r.masked for r in rollouts)


def test_a_wide_tree_cut_at_its_trunk_gives_the_logprobs_gradient_and_loss_of_the_whole_tree(
    make_cfg, tmp_path, monkeypatch
):
    """Three groups behind one system turn form one tree; cut into a piece per group (the trunk
    copied into each, grpo.trainer.tree_split), the step is the same."""
    rollouts = random_rollouts(4)
    system_turn = [7, 8, 9, 10]
    for rollout in rollouts:
        rollout.prompt_ids = system_turn + rollout.prompt_ids
    rows, _ = pack_rollouts(rollouts, 512, share_prefixes=True)
    trainer = _float32_trainer(make_cfg, tmp_path, monkeypatch, True, LossConfig(), 1)

    def pieces(pair_weight: float) -> list[int]:
        trainer._pair_weight = pair_weight
        return [int(f.input_ids.shape[0]) for mb in trainer._micro_batches(rows) for f in mb.forwards or []]

    assert sum(pieces(0.0)) == 1 and sum(pieces(1.0)) == 2  # the third group shares the first's prompt

    results = []
    for pair_weight in (0.0, 1.0):
        trainer._pair_weight = pair_weight
        results.append((_loss_token_logprobs(trainer, rows), *_gradients(trainer, rows)))
    (whole_lp, whole_grads, whole_sums), (cut_lp, cut_grads, cut_sums) = results
    assert whole_lp.keys() == cut_lp.keys() and len(whole_lp) == sum(r.num_loss_tokens for r in rows)
    np.testing.assert_allclose([cut_lp[k] for k in whole_lp], list(whole_lp.values()), atol=2e-5, rtol=0)
    assert whole_grads.keys() == cut_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(
            cut_grads[name], grad, atol=1e-5 * scale, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert cut_sums.num_loss_tokens == whole_sums.num_loss_tokens
    assert cut_sums.loss == pytest.approx(whole_sums.loss, abs=1e-5)
    assert cut_sums.entropy_sum == pytest.approx(whole_sums.entropy_sum, rel=1e-5)
    trainer.close()
