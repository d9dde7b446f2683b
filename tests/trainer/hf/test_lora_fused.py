"""The fused LoRA linear: peft's values and gradients, in float32 and in a bf16 policy under autocast,
and peft's own forward wherever it does not apply. On whatever device the trainer picks (CUDA where
present)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

import grpo.trainer.hf.model as trainer_model
from grpo.trainer.hf.lora_fused import _fusable_adapter
from grpo.trainer.hf.model import build_policy
from grpo.trainer.weights import DiskWeights


@pytest.fixture(autouse=True)
def float32_policy(monkeypatch):
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)


def _lora_layers(model: torch.nn.Module) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def _policy_with_nonzero_adapters(make_cfg, tiny_model_path, **overrides):
    """peft starts lora_B at zero, under which any adapter arithmetic gives the base output."""
    policy = build_policy(
        make_cfg(lora_target_modules=["all-linear"], **overrides), DiskWeights(tiny_model_path)
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in _lora_layers(policy.model):
            weight = layer.lora_B["default"].weight
            weight.copy_(torch.randn(weight.shape, generator=generator).to(weight.device) * 0.05)
    return policy


def _forward_backward(policy, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and the trainable parameters' gradients, in the policy's precision as its
    hidden_states computes: a 16-bit policy under autocast, peft's input casting off."""
    from peft.helpers import disable_input_dtype_casting

    policy.model.zero_grad(set_to_none=True)
    precision = contextlib.ExitStack()
    if policy.autocast_dtype is not None:
        precision.enter_context(torch.autocast(input_ids.device.type, dtype=policy.autocast_dtype))
        precision.enter_context(disable_input_dtype_casting(policy.model))
    with precision:
        logits = policy.model(input_ids=input_ids).logits  # [1, S, V]
    (logits.float().square().mean()).backward()
    grads = [p.grad.clone() for p in policy.trainable_parameters()]
    return logits.detach(), grads


def test_every_plain_lora_linear_gets_the_fused_forward(make_cfg, tiny_model_path):
    policy = build_policy(make_cfg(lora_target_modules=["all-linear"]), DiskWeights(tiny_model_path))
    layers = _lora_layers(policy.model)
    assert layers and all("forward" in vars(layer) for layer in layers)


def test_fused_layers_give_peft_outputs_and_its_gradients_to_float32_rounding(make_cfg, tiny_model_path):
    policy = _policy_with_nonzero_adapters(make_cfg, tiny_model_path)
    input_ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.to(policy.device)
    assert policy.dtype == torch.float32
    fused_logits, fused_grads = _forward_backward(policy, input_ids)
    for layer in _lora_layers(policy.model):
        del layer.forward  # back to peft's class forward
    peft_logits, peft_grads = _forward_backward(policy, input_ids)
    assert torch.equal(fused_logits, peft_logits)
    assert len(fused_grads) == len(peft_grads) > 0
    # A hidden state feeding q, k and v gets its gradient's terms summed in another order.
    for fused, peft in zip(fused_grads, peft_grads, strict=True):
        torch.testing.assert_close(fused, peft, rtol=1e-5, atol=1e-6 * float(peft.abs().max()))
    assert any(g.abs().sum() > 0 for g in fused_grads)


# alpha 8 at rank 4: scaling 2, applied on the [tokens, r] side; alpha 12: 3, on the output's
@pytest.mark.parametrize("lora_alpha", [8, 12])
def test_a_bf16_policy_under_autocast_fuses_with_peft_outputs_bit_for_bit(
    make_cfg, tiny_model_path, monkeypatch, lora_alpha
):
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.bfloat16)
    policy = _policy_with_nonzero_adapters(make_cfg, tiny_model_path, lora_alpha=lora_alpha)
    assert (policy.dtype, policy.autocast_dtype) == (torch.bfloat16, torch.bfloat16)
    layers = _lora_layers(policy.model)
    x = torch.randn(3, layers[0].in_features, device=policy.device, dtype=torch.bfloat16)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        assert _fusable_adapter(layers[0], x, (), {}) == "default"
    input_ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.to(policy.device)

    fused_logits, fused_grads = _forward_backward(policy, input_ids)
    for layer in layers:
        del layer.forward
    peft_logits, peft_grads = _forward_backward(policy, input_ids)

    # every rounding where autocast rounds peft's forward: the same logits, not merely close ones
    assert torch.equal(fused_logits, peft_logits)
    assert all(g.dtype == torch.float32 for g in fused_grads) and len(fused_grads) == len(peft_grads) > 0
    # a hidden state feeding q, k and v gets its bf16 gradient's terms summed in another order
    for fused, peft in zip(fused_grads, peft_grads, strict=True):
        torch.testing.assert_close(fused, peft, rtol=0.05, atol=0.02 * float(peft.abs().max()))
    assert any(g.abs().sum() > 0 for g in fused_grads)


def test_a_disabled_adapter_computes_the_base_model(make_cfg, tiny_model_path):
    policy = _policy_with_nonzero_adapters(make_cfg, tiny_model_path)
    input_ids = torch.arange(12, device=policy.device)[None]
    with torch.no_grad():
        adapted = policy.model(input_ids=input_ids).logits
        with policy.model.disable_adapter():
            disabled = policy.model(input_ids=input_ids).logits
        for layer in _lora_layers(policy.model):
            layer.lora_B["default"].weight.zero_()
        base = policy.model(input_ids=input_ids).logits
    assert not torch.equal(adapted, base)
    assert torch.equal(disabled, base)


@pytest.mark.parametrize("case", ["bf16 input", "autocast", "dropout"])
def test_16_bit_autocast_and_dropout_calls_keep_peft_forward(make_cfg, tiny_model_path, case):
    dropout = 0.1 if case == "dropout" else 0.0
    policy = build_policy(make_cfg(lora_dropout=dropout), DiskWeights(tiny_model_path))
    layer = _lora_layers(policy.model)[0]
    x = torch.randn(2, 3, layer.in_features, device=policy.device)
    assert _fusable_adapter(layer, x, (), {}) == (None if case == "dropout" else "default")
    if case == "bf16 input":
        assert _fusable_adapter(layer, x.bfloat16(), (), {}) is None
    if case == "autocast":
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            assert _fusable_adapter(layer, x, (), {}) is None
