"""Trainer steps on the tiny model: on-policy sanity, learning, frozen base, metrics, publishing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from trainer_batches import default_rows, make_row, on_policy_batch, reference_batch, reference_logprobs

from grpo.trainer.hf.trainer import Trainer
from grpo.transport.batches.batch import TrainingBatch
from grpo.utils.atomic import is_stable
from grpo.utils.jsonl import read_jsonl


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_logprobs_match_a_plain_hf_forward_so_an_on_policy_step_has_zero_kl(
    make_cfg, tmp_path, tiny_model_path
):
    trainer = Trainer(make_cfg(), tmp_path)
    rows = default_rows()  # row 0 is sampled at temperature 0.8, row 1 at 1.0
    batch = reference_batch(tiny_model_path, 0, rows)
    for row, scored in zip(batch.rows, trainer.score(rows), strict=True):
        # bf16 forward vs the float32 reference: ~5e-3; a wrong temperature is off by ~0.1
        np.testing.assert_allclose(scored[row.loss_mask], row.inference_logprobs[row.loss_mask], atol=2e-2)
    metrics = trainer.train_step(batch)
    assert metrics["mismatch_kl"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["masked"] == 0.0
    assert metrics["tokens"] == 6 + 7 + 5 + 4 + 4
    assert metrics["entropy"] > 0.0
    assert metrics["grad_norm"] > 0.0
    trainer.close()


def test_every_lora_parameter_learns_and_the_base_stays_frozen(make_cfg, tmp_path):
    # LoRA B starts at zero, so step 1 only moves B (A's gradient is B^T-weighted = 0); once B is
    # non-zero, step 2 moves A too. Hence: B after step 1, everything after step 2.
    trainer = Trainer(make_cfg(), tmp_path)
    before = _snapshot(trainer.policy.model)
    trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
    after_one = _snapshot(trainer.policy.model)
    trainer.train_step(on_policy_batch(trainer, 1, default_rows(seed=5)))
    after_two = _snapshot(trainer.policy.model)
    trainable = {n for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
    lora_b = {n for n in trainable if "lora_B" in n}
    assert lora_b and all(not torch.equal(before[n], after_one[n]) for n in lora_b)
    assert all(not torch.equal(before[n], after_two[n]) for n in trainable)
    frozen = set(before) - trainable
    assert frozen and all(torch.equal(before[n], after_two[n]) for n in frozen)
    trainer.close()


def test_positive_advantage_raises_the_logprob_of_its_tokens(make_cfg, tmp_path):
    trainer = Trainer(make_cfg(learning_rate=5e-3), tmp_path)
    rows = [make_row([(4, 8)], [1.0], seed=11)]
    batch = on_policy_batch(trainer, 0, rows)
    before = batch.rows[0].inference_logprobs[batch.rows[0].loss_mask].sum()
    for step in range(3):
        trainer.train_step(TrainingBatch(step=step, rows=batch.rows))
    after = trainer.score(batch.rows)[0][batch.rows[0].loss_mask].sum()
    assert after > before + 0.1
    trainer.close()


def test_metrics_are_written_per_step(make_cfg, tmp_path):
    trainer = Trainer(make_cfg(warmup_steps=2), tmp_path)
    for step in range(2):
        trainer.train_step(on_policy_batch(trainer, step, default_rows(seed=step)), wait_time=0.25)
    trainer.close()
    records = read_jsonl(tmp_path / "trainer_metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    keys = {
        "mismatch_kl",
        "masked",
        "tokens",
        "loss",
        "grad_norm",
        "grad_norm_before_clip",
        "entropy",
        "lr",
        "step_time",
        "wait_time",
        "tokens_per_s",
        "model_tflops_per_s",
        "mfu",
        "time/generation_wait",
        "time/forward_backward",
        "time/optimizer",
    }
    assert keys <= set(records[0])
    # the tiny model on this CPU: some work done, never above the probed peak
    assert all(0.0 < r["mfu"] < 1.0 and r["model_tflops_per_s"] > 0.0 for r in records)
    first = records[0]
    assert first["time/forward_backward"] + first["time/optimizer"] == pytest.approx(first["step_time"])
    assert records[0]["lr"] == pytest.approx(0.5e-2) and records[1]["lr"] == pytest.approx(1e-2)
    assert records[0]["wait_time"] == 0.25


def test_teacher_kl_compares_the_teacher_with_the_student_at_temperature_1(
    make_cfg, tmp_path, tiny_model_path
):
    # The teacher's logprobs are prompt logprobs, at temperature 1; these rows were sampled at 0.5,
    # where the student's logprobs differ from its temperature-1 ones by ~0.3.
    trainer = Trainer(make_cfg(loss={"teacher_tau": 0.5}), tmp_path)
    rows = [
        make_row([(5, 6), (4, 7)], [1.0, -1.0], seed=0, temperature=0.5),
        make_row([(3, 9)], [0.5], seed=1),
    ]
    batch = reference_batch(tiny_model_path, 0, rows)
    at_one = reference_logprobs(tiny_model_path, batch.rows, temperature=1.0)
    for row, student in zip(batch.rows, at_one, strict=True):
        row.teacher_logprobs = np.where(row.loss_mask, student + 0.3, 0).astype(np.float32)
    metrics = trainer.train_step(batch)
    assert metrics["teacher_kl"] == pytest.approx(np.exp(0.3) - 1 - 0.3, rel=1e-2)
    trainer.close()


def test_dr_grpo_constant_normaliser_divides_the_step_loss(make_cfg, tmp_path, tiny_model_path):
    constant = 1000
    loss = {"normalization": "constant", "normalization_constant": constant}
    trainer = Trainer(make_cfg(loss=loss), tmp_path)
    rows = [make_row([(5, 6), (4, 7)], [1.0, 2.0], seed=3), make_row([(3, 9)], [0.5], seed=4)]
    batch = reference_batch(tiny_model_path, 0, rows)
    # on-policy (ratio 1, kl_tau 0): loss = -sum(A * logprob) / constant, not / the 22 loss tokens
    expected = -sum(float((r.advantages * r.inference_logprobs)[r.loss_mask].sum()) for r in rows) / constant
    metrics = trainer.train_step(batch)
    assert metrics["tokens"] == 22
    assert metrics["loss"] == pytest.approx(expected, rel=1e-2)
    trainer.close()


def test_published_adapter_loads_with_peft_and_matches_the_trainer(make_cfg, tmp_path, tiny_model_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = Trainer(make_cfg(), tmp_path)
    trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
    trainer.train_step(on_policy_batch(trainer, 1, default_rows(seed=2)))
    for version in (1, 2, 3):
        folder = trainer.publish(version)
    assert is_stable(folder) and (folder / "adapter_config.json").exists()
    # max_async_level 1 keeps two versions
    assert sorted(p.name for p in (tmp_path / "broadcasts").iterdir()) == ["step_2", "step_3"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=trainer.policy.dtype)
    loaded = PeftModel.from_pretrained(base, folder)
    saved = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    live = {n: p for n, p in trainer.policy.model.named_parameters() if "lora_" in n}
    assert set(saved) == set(live)
    assert all(torch.allclose(saved[n].float(), live[n].float().cpu()) for n in saved)
    trainer.close()


def test_full_training_publishes_hf_safetensors(make_cfg, tmp_path):
    trainer = Trainer(make_cfg(lora=False, learning_rate=1e-4), tmp_path)
    before = _snapshot(trainer.policy.model)
    trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(before[name], trainer.policy.causal_lm.get_parameter(name))
    folder = trainer.publish(1)
    weights = load_file(str(folder / "model.safetensors"))
    assert torch.equal(weights[name], trainer.policy.causal_lm.get_parameter(name).detach().cpu())
    trainer.close()


def test_qerl_publishes_noisy_norms_and_trains_on_clean_ones(make_cfg, tmp_path):
    noise = {"enabled": True, "num_stages": 2, "sigma_start": 0.1, "sigma_end": 0.01}
    trainer = Trainer(make_cfg(max_steps=4, noise_scheduler=noise), tmp_path)
    clean = trainer.policy.causal_lm.get_parameter("model.norm.weight").detach().clone().cpu()
    first = load_file(str(trainer.publish(1) / "noisy_norms.safetensors"))
    late = load_file(str(trainer.publish(3) / "noisy_norms.safetensors"))
    assert "model.layers.0.input_layernorm.weight" in late
    assert torch.equal(first["model.norm.weight"], clean.float())  # first stage: no noise
    assert (late["model.norm.weight"] - clean.float()).std().item() == pytest.approx(0.1, rel=0.3)
    assert torch.equal(trainer.policy.causal_lm.get_parameter("model.norm.weight").cpu(), clean)
    trainer.close()


def test_a_step_with_a_non_finite_gradient_is_skipped_and_counted(make_cfg, tmp_path):
    trainer = Trainer(make_cfg(), tmp_path)
    batch = on_policy_batch(trainer, 0, default_rows())
    batch.rows[0].advantages[batch.rows[0].loss_mask] = np.nan  # a NaN that reached the trainer
    before = _snapshot(trainer.policy.model)
    metrics = trainer.train_step(batch)
    assert not np.isfinite(metrics["grad_norm"]) and metrics["skipped_steps"] == 1.0
    assert all(torch.equal(before[n], p) for n, p in trainer.policy.model.named_parameters())
    # The next good step trains normally: the optimizer state was not poisoned either.
    metrics = trainer.train_step(on_policy_batch(trainer, 1, default_rows()))
    assert np.isfinite(metrics["grad_norm"]) and metrics["skipped_steps"] == 1.0
    assert all(torch.isfinite(p).all() for p in trainer.policy.model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in trainer.policy.model.named_parameters())
    trainer.close()


def test_a_masked_token_whose_ratio_overflows_does_not_make_the_loss_nan(make_cfg, tmp_path):
    trainer = Trainer(make_cfg(), tmp_path)
    batch = on_policy_batch(trainer, 0, default_rows())
    row = batch.rows[0]
    first_loss_token = int(np.flatnonzero(row.loss_mask)[0])
    row.inference_logprobs[first_loss_token] = -9999.0  # vLLM's stand-in: the ratio is exp(~9999) = inf
    metrics = trainer.train_step(batch)
    assert metrics["masked"] > 0 and np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    # The masked token is left out.
    assert np.isfinite(metrics["mismatch_kl"]) and np.isfinite(metrics["entropy"])
    trainer.close()


def test_grad_norm_is_the_norm_after_clipping_and_grad_norm_before_clip_the_one_before(make_cfg, tmp_path):
    trainer = Trainer(make_cfg(max_grad_norm=1e-3), tmp_path)
    metrics = trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
    applied = torch.nn.utils.get_total_norm([p.grad for p in trainer.params if p.grad is not None])
    assert metrics["grad_norm_before_clip"] > 1e-2  # the step was clipped
    assert metrics["grad_norm"] == pytest.approx(float(applied), rel=1e-4)
    assert metrics["grad_norm"] == pytest.approx(1e-3, rel=1e-3)
    trainer.close()


@pytest.fixture
def float16_compute(monkeypatch):
    """The trainer computing in float16, as over a float16 engine's borrowed weights."""
    import grpo.trainer.hf.model as model_module

    monkeypatch.setattr(model_module, "choose_dtype", lambda device: torch.float16)


@pytest.mark.usefixtures("float16_compute")
def test_a_float16_trainer_scales_its_gradients_and_backs_off_on_an_overflow(make_cfg, tmp_path):
    from grpo.trainer.grad_scale import INITIAL_SCALE

    trainer = Trainer(make_cfg(output_dir=str(tmp_path)), tmp_path)
    assert trainer.policy.dtype == torch.float16 and trainer.grad_scale is not None
    before = _snapshot(trainer.policy.model)
    metrics = trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
    assert metrics["fp16_grad_scale"] == INITIAL_SCALE and metrics["skipped_steps"] == 0
    after = _snapshot(trainer.policy.model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed and all(torch.isfinite(after[n]).all() for n in changed)

    # A scale no float16 product survives: the step is skipped, the weights kept, the scale halved.
    trainer.grad_scale.scale = 2.0**60
    metrics = trainer.train_step(on_policy_batch(trainer, 1, default_rows(seed=5)))
    assert metrics["skipped_steps"] == 1 and metrics["fp16_grad_scale"] == 2.0**59
    assert all(torch.equal(t, after[n]) for n, t in _snapshot(trainer.policy.model).items())

    trainer.grad_scale.scale = 1024.0
    folder = trainer.save_checkpoint()
    trainer.close()
    from grpo.trainer.hf.checkpoint import load_checkpoint

    fresh = Trainer(make_cfg(output_dir=str(tmp_path / "fresh")), tmp_path / "fresh")
    assert (
        load_checkpoint(folder, fresh.policy, fresh.optimizer, fresh.scheduler, None, fresh.grad_scale) == 2
    )
    assert fresh.grad_scale is not None and fresh.grad_scale.scale == 1024.0
    fresh.close()


def test_a_bf16_or_float32_trainer_has_no_gradient_scale(make_cfg, tmp_path):
    trainer = Trainer(make_cfg(output_dir=str(tmp_path)), tmp_path)
    metrics = trainer.train_step(on_policy_batch(trainer, 0, default_rows()))
    assert trainer.grad_scale is None and "fp16_grad_scale" not in metrics
    trainer.close()
