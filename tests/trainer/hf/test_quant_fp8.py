"""qlora_fp8: FP8 block-quantized frozen base, dequantized per matmul, LoRA trained on top."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.trainer.hf.dequant import dequantize_fp8_block
from grpo.trainer.hf.model import Policy, build_policy
from grpo.trainer.hf.quantized_base import (
    base_linear_bytes,
    decoder_linear_names,
    quantize_fp8_block,
    quantized_linear_class,
)
from grpo.trainer.quantized_weights import FP8BlockWeight
from grpo.trainer.weights import DiskWeights

# E4M3 keeps 3 mantissa bits: round-to-nearest moves a weight by at most 2^-4 of its magnitude,
# ~2^-4/sqrt(3) = 3.6% rms for uniformly spread mantissas, and a layer's output inherits about that.
# Measured relative logits error (bf16 compute, these inputs): 4.4% for the tiny model and 4.3% for
# SmolLM2-135M. 8% leaves room for fp32-compute CPUs without hiding a wrong scale or layout (a
# tile off by one power of two alone gives >= 25%, a mis-mapped tile ~140%).
LOGITS_REL_ERROR_BOUND = 0.08


def _logits(policy: Policy, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return policy.model(input_ids=input_ids.to(policy.device)).logits.float().cpu()


def _input_ids() -> torch.Tensor:
    return torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def fp8_policy(make_cfg, tiny_model_path: Path) -> Policy:
    return build_policy(
        make_cfg(qlora_fp8=True, lora_target_modules=["all-linear"]), DiskWeights(tiny_model_path)
    )


def test_quantize_fp8_block_round_trips_within_e4m3_precision() -> None:
    torch.manual_seed(0)
    weight = torch.randn(200, 300)  # not a multiple of 128: partial edge tiles
    quantized = quantize_fp8_block(weight)
    assert quantized.weight.dtype == torch.float8_e4m3fn and quantized.weight.shape == (200, 300)
    assert quantized.scale.shape == (2, 3) and quantized.scale.dtype == torch.float32
    restored = dequantize_fp8_block(quantized, dtype=torch.float32)
    # Per element: at most half an E4M3 step (2^-4 relative) above the subnormal range.
    relative = (restored - weight).abs() / weight.abs().clamp(min=1e-2)
    assert relative.max() <= 2**-4 + 1e-6
    # Each tile's largest magnitude maps to the largest finite E4M3 value, so nothing saturates.
    assert quantized.weight.float().abs().max() == 448.0


def test_all_zero_tile_quantizes_to_zeros() -> None:
    weight = torch.zeros(128, 256)
    weight[:, 128:] = 1.0
    quantized = quantize_fp8_block(weight)
    restored = dequantize_fp8_block(quantized, dtype=torch.float32)
    assert torch.equal(restored, weight)


def test_fp8_base_linears_hold_only_fp8_codes_and_block_scales(fp8_policy: Policy) -> None:
    names = decoder_linear_names(fp8_policy.causal_lm)
    assert len(names) == 2 * 7
    for name in names:
        base = fp8_policy.causal_lm.get_submodule(name)
        assert isinstance(base, quantized_linear_class())
        assert base.weight.dtype == torch.float8_e4m3fn and not isinstance(base.weight, torch.nn.Parameter)
        assert base.weight_scale.dtype == torch.float32
    # No dense copy anywhere: every parameter/buffer byte is accounted for by the non-linear
    # parameters, the LoRA adapters, and one byte per base-linear weight plus the scales.
    model = fp8_policy.model
    all_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    lora_bytes = sum(p.numel() * p.element_size() for p in fp8_policy.trainable_parameters())
    other_bytes = sum(  # embeddings, norms, rotary tables
        t.numel() * t.element_size()
        for n, t in [*fp8_policy.causal_lm.named_parameters(), *fp8_policy.causal_lm.named_buffers()]
        if not t.requires_grad and not any(n.startswith(f"{name}.") for name in names)
    )
    num_linear_weights = sum(fp8_policy.causal_lm.get_submodule(n).weight.numel() for n in names)
    num_scales = sum(fp8_policy.causal_lm.get_submodule(n).weight_scale.numel() for n in names)
    assert base_linear_bytes(fp8_policy.causal_lm) == num_linear_weights + 4 * num_scales
    assert all_bytes == other_bytes + lora_bytes + num_linear_weights + 4 * num_scales


def test_fp8_logits_are_close_to_the_dense_models(
    make_cfg, tiny_model_path: Path, fp8_policy: Policy
) -> None:
    dense = build_policy(make_cfg(lora_target_modules=["all-linear"]), DiskWeights(tiny_model_path))
    assert dense.dtype == fp8_policy.dtype
    input_ids = _input_ids()
    reference, got = _logits(dense, input_ids), _logits(fp8_policy, input_ids)
    relative_error = ((got - reference).norm() / reference.norm()).item()
    assert 0 < relative_error < LOGITS_REL_ERROR_BOUND


def test_fp8_forward_equals_a_dense_model_holding_the_dequantized_weights(
    make_cfg, tiny_model_path: Path, fp8_policy: Policy
) -> None:
    dense = build_policy(make_cfg(lora_target_modules=["all-linear"]), DiskWeights(tiny_model_path))
    for name in decoder_linear_names(fp8_policy.causal_lm):
        base = fp8_policy.causal_lm.get_submodule(name)
        restored = dequantize_fp8_block(FP8BlockWeight(base.weight, base.weight_scale), dtype=dense.dtype)
        dense.causal_lm.get_submodule(name).weight.data.copy_(restored)
    input_ids = _input_ids()
    torch.testing.assert_close(_logits(fp8_policy, input_ids), _logits(dense, input_ids))


def test_lora_on_fp8_base_learns_and_base_stays_frozen(fp8_policy: Policy) -> None:
    names = decoder_linear_names(fp8_policy.causal_lm)
    base_before = {n: fp8_policy.causal_lm.get_submodule(n).weight.clone() for n in names}
    lora_before = {n: p.detach().clone() for n, p in fp8_policy.model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(fp8_policy.trainable_parameters(), lr=1e-2)
    input_ids = _input_ids().to(fp8_policy.device)
    losses = []
    for _ in range(8):
        loss = fp8_policy.model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    changed = [
        n
        for n, p in fp8_policy.model.named_parameters()
        if p.requires_grad and not torch.equal(p, lora_before[n])
    ]
    assert len(changed) == len(lora_before)
    for n in names:
        assert torch.equal(
            fp8_policy.causal_lm.get_submodule(n).weight.view(torch.uint8), base_before[n].view(torch.uint8)
        )


def test_adapter_trained_on_fp8_base_loads_on_the_unquantized_base(
    fp8_policy: Policy, tiny_model_path: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        for name, param in fp8_policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # a trained-looking adapter, not B = 0
    fp8_policy.model.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=fp8_policy.dtype)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    saved = {n: p for n, p in fp8_policy.model.named_parameters() if "lora_" in n}
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert saved.keys() == got.keys()
    for name, param in saved.items():
        torch.testing.assert_close(got[name].float(), param.float().cpu())
    input_ids = _input_ids()
    with torch.no_grad():
        reference = loaded(input_ids=input_ids).logits.float()
    relative_error = ((_logits(fp8_policy, input_ids) - reference).norm() / reference.norm()).item()
    assert relative_error < LOGITS_REL_ERROR_BOUND
