"""The Megatron backend's train step equals the HF backend's full-parameter step on the same batch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from trainer_batches import make_row, on_policy_batch

from grpo.config.trainer import TrainerConfig


def _batch(hf_trainer: object) -> object:
    rows = [
        make_row([(6, 10), (4, 12)], [1.0, -1.0], seed=1, temperature=0.7),
        make_row([(9, 7)], [0.5], seed=2, temperature=1.3),
        make_row([(5, 9), (3, 6)], [-0.5, 2.0], seed=3),
    ]
    batch = on_policy_batch(hf_trainer, 0, rows)
    for row in batch.rows:  # off-policy a little, so the ratios and the KL are not trivial
        row.inference_logprobs = np.where(row.loss_mask, row.inference_logprobs - 0.05, 0).astype(np.float32)
    return batch


@pytest.mark.usefixtures("float32_compute")
@pytest.mark.parametrize("use_distributed_optimizer", [True, False])
def test_one_megatron_update_equals_the_hf_backends_full_update(
    use_distributed_optimizer: bool,
    tiny_llama_tp2_path: Path,
    make_cfg: Callable[..., TrainerConfig],
    megatron_cfg: Callable[..., TrainerConfig],
    tmp_path: Path,
) -> None:
    from grpo.trainer.hf.trainer import Trainer
    from grpo.trainer.megatron.trainer import MegatronTrainer

    # Adam's first step moves every weight by about lr * g / (|g| + eps): with eps 1e-8 a gradient
    # entry at float32 noise level (1e-9) moves its weight by a sizeable part of lr, whichever
    # backend computed it. A larger eps keeps the update a smooth function of the gradient.
    common = {
        "model": str(tiny_llama_tp2_path),
        "learning_rate": 1e-3,
        "max_grad_norm": 0.5,
        "adam_epsilon": 1e-5,
    }
    hf = Trainer(make_cfg(lora=False, optimizer="adamw", **common), tmp_path / "hf")
    batch = _batch(hf)
    megatron = MegatronTrainer(
        megatron_cfg(megatron={"use_distributed_optimizer": use_distributed_optimizer}, **common),
        tmp_path / "megatron",
    )
    whole = megatron.hf_state_dict()
    assert whole is not None
    before = {name: tensor.clone() for name, tensor in whole.items()}
    hf_metrics = hf.train_step(copy.deepcopy(batch))
    megatron_metrics = megatron.train_step(copy.deepcopy(batch))
    for key in (
        "loss",
        "mismatch_kl",
        "entropy",
        "masked",
        "tokens",
        "grad_norm",
        "grad_norm_before_clip",
        "lr",
    ):
        assert megatron_metrics[key] == pytest.approx(hf_metrics[key], rel=1e-4, abs=1e-6), key
    assert hf_metrics["grad_norm_before_clip"] > 0.5  # clipped: the clipping is compared too
    # both backends count the same model FLOPs for the same full update (mfu's numerator)
    hf_flops = hf_metrics["model_tflops_per_s"] * hf_metrics["step_time"]
    assert megatron_metrics["model_tflops_per_s"] * megatron_metrics["step_time"] == pytest.approx(hf_flops)
    after = megatron.hf_state_dict()
    assert after is not None
    hf_after = hf.policy.causal_lm.state_dict()
    for name, tensor in after.items():
        assert not torch.equal(tensor, before[name]), f"{name} did not change"
        torch.testing.assert_close(tensor, hf_after[name], atol=1e-6, rtol=0, msg=name)  # lr is 1e-3
    hf.close()
    megatron.close()


@pytest.mark.usefixtures("float32_compute")
def test_activation_recomputation_changes_no_number_of_the_step(
    tiny_llama_tp2_path: Path,
    make_cfg: Callable[..., TrainerConfig],
    megatron_cfg: Callable[..., TrainerConfig],
    tmp_path: Path,
) -> None:
    from grpo.trainer.hf.trainer import Trainer
    from grpo.trainer.megatron.trainer import MegatronTrainer

    hf = Trainer(make_cfg(model=str(tiny_llama_tp2_path), lora=False), tmp_path / "hf")
    batch = _batch(hf)
    hf.close()
    results = {}
    for recompute in ("none", "full", "selective"):
        cfg = megatron_cfg(model=str(tiny_llama_tp2_path), megatron={"recompute": recompute})
        trainer = MegatronTrainer(cfg, tmp_path / recompute)
        metrics = trainer.train_step(copy.deepcopy(batch))
        weights = trainer.hf_state_dict()
        assert weights is not None
        results[recompute] = (metrics, {k: v.clone() for k, v in weights.items()})
        trainer.close()
    plain_metrics, plain_weights = results["none"]
    for recompute in ("full", "selective"):
        metrics, weights = results[recompute]
        assert metrics["loss"] == plain_metrics["loss"] and metrics["grad_norm"] == pytest.approx(
            plain_metrics["grad_norm"], rel=1e-6
        )
        for name, tensor in weights.items():
            torch.testing.assert_close(
                tensor, plain_weights[name], atol=1e-7, rtol=0, msg=f"{recompute}: {name}"
            )


LOSS_VARIANTS = {
    "teacher term": {"loss": {"teacher_tau": 0.5}},
    "constant normalization and kl term": {
        "loss": {"normalization": "constant", "normalization_constant": 64, "kl_tau": 0.1}
    },
    "sequence ratio and tight token masks": {
        "loss": {"ratio_type": "sequence", "token_mask_low": 0.97, "token_mask_high": 1.03}
    },
    "whole batch in one micro-batch, weight decay": {"per_device_train_batch_size": 3, "weight_decay": 0.1},
}


@pytest.mark.usefixtures("float32_compute")
@pytest.mark.parametrize("variant", list(LOSS_VARIANTS))
def test_loss_variants_update_as_the_hf_backend_does(
    variant: str,
    tiny_llama_tp2_path: Path,
    make_cfg: Callable[..., TrainerConfig],
    megatron_cfg: Callable[..., TrainerConfig],
    tmp_path: Path,
) -> None:
    from grpo.trainer.hf.trainer import Trainer
    from grpo.trainer.megatron.trainer import MegatronTrainer

    common = {
        "model": str(tiny_llama_tp2_path),
        "learning_rate": 1e-3,
        "max_grad_norm": 0.5,
        "adam_epsilon": 1e-5,  # see the test above
        **LOSS_VARIANTS[variant],
    }
    # backend hf sizes micro-batches in tokens: the same rows (of sequence_len 1024) in one micro-batch
    rows = common.pop("per_device_train_batch_size", None)
    hf_sizes = {} if rows is None else {"micro_batch_tokens": rows * 1024}
    hf = Trainer(make_cfg(lora=False, optimizer="adamw", **common, **hf_sizes), tmp_path / "hf")
    if rows is not None:
        common["per_device_train_batch_size"] = rows
    batch = _batch(hf)
    rng = np.random.default_rng(0)
    for row in batch.rows:  # ratios that differ per token, so token masks pick some out
        noise = rng.normal(0, 0.02, len(row.input_ids))
        row.inference_logprobs = np.where(row.loss_mask, row.inference_logprobs + noise, 0).astype(np.float32)
        row.teacher_logprobs = np.where(row.loss_mask, row.inference_logprobs - 0.3, 0).astype(np.float32)
    megatron = MegatronTrainer(megatron_cfg(**common), tmp_path / "megatron")
    hf_metrics = hf.train_step(copy.deepcopy(batch))
    megatron_metrics = megatron.train_step(copy.deepcopy(batch))
    for key in (
        "loss",
        "mismatch_kl",
        "teacher_kl",
        "entropy",
        "masked",
        "tokens",
        "grad_norm",
        "grad_norm_before_clip",
    ):
        assert megatron_metrics[key] == pytest.approx(hf_metrics[key], rel=1e-4, abs=1e-6), key
    assert 0 < hf_metrics["masked"] < 1 if "masks" in variant else hf_metrics["masked"] == 0
    after = megatron.hf_state_dict()
    assert after is not None
    hf_after = hf.policy.causal_lm.state_dict()
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, hf_after[name], atol=1e-6, rtol=0, msg=name)
    hf.close()
    megatron.close()
