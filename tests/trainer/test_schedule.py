"""Learning-rate schedules, the optimizer choice and the QeRL sigma schedule."""

from __future__ import annotations

import math

import pytest

from grpo.config.trainer import NoiseSchedulerConfig, TrainerConfig
from grpo.trainer.noise import noise_sigma
from grpo.trainer.optim import build_optimizer, lr_multiplier


def _cfg(**kw) -> TrainerConfig:
    return TrainerConfig(model="x", **kw)


def test_warmup_is_linear_then_constant():
    cfg = _cfg(warmup_steps=4, max_steps=10)
    assert [lr_multiplier(cfg, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_reaches_min_lr_ratio_at_max_steps():
    cfg = _cfg(lr_scheduler_type="linear", max_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(cfg, 0) == 1.0
    assert lr_multiplier(cfg, 5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(cfg, 10) == pytest.approx(0.1)


def test_cosine_decay_after_warmup():
    cfg = _cfg(lr_scheduler_type="cosine", max_steps=12, warmup_steps=2)
    assert lr_multiplier(cfg, 2) == 1.0
    assert lr_multiplier(cfg, 7) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(cfg, 12) == pytest.approx(0.0)


def test_open_ended_run_does_not_decay():
    assert lr_multiplier(_cfg(lr_scheduler_type="cosine", max_steps=-1), 1000) == 1.0


def test_qerl_sigma_is_zero_first_then_decays_geometrically():
    noise = NoiseSchedulerConfig(enabled=True, sigma_start=1e-1, sigma_end=1e-3, num_stages=4)
    sigmas = [noise_sigma(noise, step, max_steps=8) for step in range(8)]
    assert sigmas[:2] == [0.0, 0.0]
    assert sigmas[2:4] == pytest.approx([1e-1, 1e-1])
    assert sigmas[4:6] == pytest.approx([1e-2, 1e-2])
    assert sigmas[6:8] == pytest.approx([1e-3, 1e-3])


def test_qerl_disabled_or_open_ended():
    assert noise_sigma(NoiseSchedulerConfig(), 5, 10) == 0.0
    with pytest.raises(ValueError, match="max_steps"):
        noise_sigma(NoiseSchedulerConfig(enabled=True), 5, -1)


def test_full_fine_tuning_steps_with_fused_adamw_and_lora_with_the_per_op_loop():
    import torch

    params = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))]
    full = build_optimizer(_cfg(lora=False), params, torch.device("cpu"))
    lora = build_optimizer(_cfg(lora=True), params, torch.device("cpu"))
    assert full.defaults["fused"] is True
    assert not lora.defaults["fused"]


def test_fused_adamw_takes_the_same_step_as_the_per_op_loop():
    import torch

    def step(lora: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
        optimizer = build_optimizer(_cfg(lora=lora, learning_rate=1e-3), params, torch.device("cpu"))
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer.step()
        return [p.detach() for p in params]

    for fused, loop in zip(step(lora=False), step(lora=True), strict=True):
        torch.testing.assert_close(fused, loop, rtol=0, atol=1e-6)
