"""Streaming: a step trained part by part as its parts arrive makes the update of the one-shot step."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from trainer_batches import distributed_test_batch, make_row

from grpo.trainer.entry import run
from grpo.trainer.hf import model as trainer_model
from grpo.trainer.hf.trainer import Trainer
from grpo.transport.batches.batch import TrainingBatch
from grpo.transport.batches.memory import memory_transport_pair
from grpo.transport.batches.parts import PartSender

_LOSS = {"token_mask_low": 0.0, "geo_mask_low": 0.0, "sequence_mask_high": 1e30, "token_mask_high": 1e30}
_ADAM_EPSILON = 1e-3
"""Adam divides by sqrt(v) + eps: with the default 1e-8 a gradient entry that is ~0 up to float
rounding (LoRA A while B is still 0) becomes a full lr-sized step of either sign, for any two
orderings of the same sums. A larger eps keeps the update a smooth function of the gradient, so
comparing weights after the step tests the gradient, which is what streaming could change."""


def _batch(step: int) -> TrainingBatch:
    """Four rows of unequal loss-token counts (so parts' token shares differ from the step's)."""
    batch = distributed_test_batch()
    extra = make_row([(2, 15), (4, 2)], [0.7, -1.2], seed=10 + step)
    extra.inference_logprobs = np.where(extra.loss_mask, -6.0, 0.0).astype(np.float32)
    return TrainingBatch(step=step, rows=[*batch.rows, extra])


def _parts(batch: TrainingBatch) -> list[TrainingBatch]:
    rows = batch.rows
    return [
        TrainingBatch(step=batch.step, rows=rows[:1]),
        TrainingBatch(step=batch.step, rows=rows[1:3]),
        TrainingBatch(step=batch.step, rows=rows[3:]),
    ]


def _trainable(trainer: Trainer, grads: bool = False) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad if grads else p).detach().float().clone()
        for n, p in trainer.policy.model.named_parameters()
        if p.requires_grad
    }


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal up to float32 rounding of sums taken in another order (the bound of test_micro_batches)."""
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        scale = float(value.abs().max()) + 1e-12
        assert torch.allclose(actual[name], value, atol=1e-5 * scale), name


@pytest.fixture
def float32(monkeypatch):
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)


@pytest.mark.parametrize(
    "loss",
    [{**_LOSS}, {**_LOSS, "normalization": "constant", "normalization_constant": 40}],
    ids=["tokens", "constant"],
)
def test_streamed_update_equals_the_one_shot_update(make_cfg, tmp_path, float32, loss):
    # Clipping on and below the gradient norm: the step's normaliser must be applied before it.
    # One row per micro-batch on both sides (micro_batch_tokens 1), as the parts arrive: the same
    # sums in the same order, so float32 rounding cannot tell the two apart.
    cfg = make_cfg(max_grad_norm=0.005, adam_epsilon=_ADAM_EPSILON, loss=loss, micro_batch_tokens=1)
    one_shot = Trainer(cfg, tmp_path / "one_shot")
    streamed = Trainer(cfg, tmp_path / "streamed")
    before = _trainable(one_shot)
    for name, value in _trainable(streamed).items():
        assert torch.equal(value, before[name]), "both trainers start from the same weights"
    for step in range(2):  # the second step also compares the optimizer state the first one left
        whole = one_shot.train_step(copy.deepcopy(_batch(step)))
        constant = cfg.loss.loss_scale(0, 0) if cfg.loss.normalization == "constant" else None
        streamed.begin_step(step, constant)
        for part in _parts(_batch(step)):
            streamed.accumulate(part)
        parted = streamed.finish_step()
        assert whole["grad_norm_before_clip"] > cfg.max_grad_norm, "the test must clip"
        for key in (
            "loss",
            "tokens",
            "mismatch_kl",
            "entropy",
            "masked",
            "grad_norm",
            "grad_norm_before_clip",
        ):
            assert parted[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
        # The gradients the optimizer used: normalised and clipped.
        _assert_close(_trainable(streamed, grads=True), _trainable(one_shot, grads=True))
    after = _trainable(one_shot)
    assert any(not torch.equal(after[n], before[n]) for n in after), "the steps changed the weights"
    _assert_close(_trainable(streamed), after)
    one_shot.close()
    streamed.close()


def test_the_trainer_loop_trains_a_step_sent_in_parts_like_the_whole_batch(make_cfg, tmp_path, float32):
    cfg = make_cfg(
        max_grad_norm=0.005, adam_epsilon=_ADAM_EPSILON, max_steps=2, loss=_LOSS, micro_batch_tokens=1
    )
    adapters = {}
    for name, num_parts in (("one_shot", 1), ("streamed", 3)):
        run_dir = tmp_path / name
        sender, receiver = memory_transport_pair(capacity=2 * num_parts)
        parts = PartSender(sender, num_parts)
        for step in range(cfg.max_steps):
            pieces = [_batch(step)] if num_parts == 1 else _parts(_batch(step))
            for index, piece in enumerate(pieces):
                parts.send(piece, index)
        run(cfg.model_copy(update={"output_dir": str(run_dir)}), run_dir, receiver, num_parts=num_parts)
        from safetensors.torch import load_file

        adapters[name] = load_file(
            run_dir / "broadcasts" / f"step_{cfg.max_steps}" / "adapter_model.safetensors"
        )
    _assert_close(adapters["streamed"], adapters["one_shot"])


def test_a_stop_between_parts_abandons_the_step(make_cfg, tmp_path):
    import threading

    cfg = make_cfg(max_steps=1, loss=_LOSS)
    sender, receiver = memory_transport_pair(capacity=4)
    PartSender(sender, 3).send(TrainingBatch(step=0, rows=_batch(0).rows[:1]), 0)
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    run(cfg.model_copy(update={"output_dir": str(tmp_path)}), tmp_path, receiver, stop, num_parts=3)
    assert not (tmp_path / "broadcasts" / "step_1").exists(), "no optimizer step from a partial step"
