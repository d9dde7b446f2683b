"""Data parallel: row balancing, a 2-rank gloo step equal to the 1-rank step on the same batch, and
ranks > 0 waiting for rank 0's batches outside collectives."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from dist_worker import (
    LATE_DIST_TIMEOUT_S,
    LATE_STEPS,
    LATE_WAIT_S,
    ORPHAN_EXIT_CODE,
    launch,
    start_without_agent,
)
from free_ports import free_port
from safetensors.torch import load_file
from trainer_batches import distributed_test_batch, distributed_test_cfg, make_row

from grpo.trainer.distributed import balance_rows
from grpo.trainer.hf.trainer import Trainer


def _row(num_tokens: int, seed: int = 0):
    return make_row([(1, num_tokens - 1)], [1.0], seed=seed)


def test_ranks_get_equal_row_counts_and_balanced_tokens():
    rows = [_row(n, seed=i) for i, n in enumerate([100, 90, 60, 50, 30, 20, 10, 5])]
    shares = balance_rows(rows, 2)
    assert [len(s) for s in shares] == [4, 4]
    tokens = [sum(r.num_tokens for r in s) for s in shares]
    assert abs(tokens[0] - tokens[1]) <= 10  # greedy: 185 vs 180
    assert sorted(id(r) for s in shares for r in s) == sorted(id(r) for r in rows)


def test_missing_rows_are_padded_with_empty_rows_that_carry_no_loss():
    rows = [_row(n, seed=i) for i, n in enumerate([40, 30, 20])]
    shares = balance_rows(rows, 2)
    assert [len(s) for s in shares] == [2, 2]
    padding = [r for s in shares for r in s if all(r is not real for real in rows)]
    assert len(padding) == 1 and padding[0].num_loss_tokens == 0 and padding[0].position_ids[0] == 0
    # The padding goes with the smallest real row, next to the largest one on the other rank.
    assert {r.num_tokens for r in shares[0]} == {40, 2} or {r.num_tokens for r in shares[1]} == {40, 2}


def test_one_rank_gets_every_row_in_batch_order():
    rows = [_row(n, seed=i) for i, n in enumerate([5, 50, 20])]
    assert balance_rows(rows, 1) == [rows]


@pytest.fixture(scope="module")
def two_rank_steps(tiny_model_path, tmp_path_factory):
    """OUT_DIR of dist_worker's `step` scenario, both modes in one torchrun launch (OUT_DIR/<mode>)."""
    out_dir = tmp_path_factory.mktemp("two_rank_step")
    launch("step", tiny_model_path, out_dir, "lora,full")
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])  # full: decoder layers sharded with FSDP2
def test_two_rank_step_equals_one_rank_step(tiny_model_path, tmp_path, mode, two_rank_steps):
    single = Trainer(distributed_test_cfg(str(tiny_model_path), lora=mode == "lora"), tmp_path / "single")
    single_metrics = single.train_step(distributed_test_batch())
    distributed = load_file(str(two_rank_steps / mode / "rank0.safetensors"))
    assert distributed["metrics.tokens"].item() == single_metrics["tokens"]
    assert distributed["metrics.loss"].item() == pytest.approx(single_metrics["loss"], rel=1e-4)
    trainable = {n: p for n, p in single.policy.model.named_parameters() if p.requires_grad}
    assert trainable and {f"param.{n}" for n in trainable} <= set(distributed)
    tolerance = 1e-4 if single.policy.dtype == torch.float32 else 2e-2  # bf16 compute
    for name, param in trainable.items():
        grad = param.grad.float()
        # Summed, not averaged, over ranks: a mean would halve every gradient.
        assert torch.allclose(
            distributed[f"grad.{name}"], grad, rtol=tolerance, atol=tolerance * grad.abs().max()
        )
        # Adam's first step is about lr * sign(grad): compare updates where the gradient is clearly
        # non-zero (the sign of a near-zero bf16 gradient may differ with the row split).
        clear = grad.abs() > 0.1 * grad.abs().max()
        after = distributed[f"param.{name}"][clear]
        assert torch.allclose(after, param.detach().float()[clear], atol=1e-3 * single.cfg.learning_rate)
    assert any(float(p.grad.abs().max()) > 0 for p in trainable.values())
    assert not np.isnan(single_metrics["loss"])
    single.close()


@pytest.mark.slow
def test_a_batch_later_than_the_process_group_timeout_still_trains(tiny_model_path, tmp_path):
    # Rank 0 waits LATE_WAIT_S for batch 1, more than dist_timeout: rank 1 must not wait in a collective.
    assert LATE_WAIT_S > 2 * LATE_DIST_TIMEOUT_S
    launch("late", tiny_model_path, tmp_path, "lora")
    rows = (tmp_path / "late" / "trainer_metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == list(range(LATE_STEPS))
    assert json.loads(rows[1])["wait_time"] >= LATE_WAIT_S
    assert (tmp_path / "late" / "checkpoints" / "trainer" / f"step_{LATE_STEPS}" / "STABLE").exists()


def test_ranks_waiting_for_a_rank_0_that_died_fail_naming_it(tmp_path):
    ranks = start_without_agent("orphan", tmp_path, free_port())
    try:
        start = time.monotonic()
        codes = [rank.wait(timeout=120) for rank in ranks]
        waited = time.monotonic() - start
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    log = (tmp_path / "rank1.log").read_text()
    assert codes[0] == ORPHAN_EXIT_CODE
    assert codes[1] != 0 and "rank 1 lost rank 0 while waiting for it (the next batch)" in log, log[-3000:]
    assert waited < 60


def test_a_rank_above_0_gets_the_kept_counts_of_rank_0s_rows_and_0s_for_a_row_without(monkeypatch):
    from types import SimpleNamespace

    from grpo.trainer import distributed
    from grpo.transport.batches.batch import TrainingBatch

    counted, without = _row(6, seed=1), _row(4, seed=2)
    counted.kept_counts = np.array([0, 20, 3, 1, 7, 2], np.int32)
    batch = TrainingBatch(step=3, rows=[counted, without])
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(distributed, "_send_or_receive", lambda tensor, ctx: sent.append(tensor) or tensor)
    gate = SimpleNamespace(pass_gate=lambda what: None)
    main = SimpleNamespace(is_main=True, device=torch.device("cpu"), gate=gate)
    assert distributed.share_batch(batch, main) is batch  # type: ignore[arg-type]
    replay = iter(sent)
    monkeypatch.setattr(distributed, "_send_or_receive", lambda tensor, ctx: next(replay))
    other = SimpleNamespace(is_main=False, device=torch.device("cpu"), gate=gate)
    got = distributed.share_batch(None, other)  # type: ignore[arg-type]
    assert got is not None and [r.kept_counts.tolist() for r in got.rows] == [
        counted.kept_counts.tolist(),
        [0] * 4,
    ]
    assert got.rows[0].kept_counts.dtype == np.int32
    np.testing.assert_array_equal(got.rows[1].input_ids, without.input_ids)
