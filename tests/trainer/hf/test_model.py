"""Building the policy: LoRA, NF4 QLoRA, full; borrowed base weights used by identity; hardware checks."""

from __future__ import annotations

import pytest
import torch

from grpo.trainer.device import resolve_device
from grpo.trainer.hf.model import build_policy
from grpo.trainer.weights import BorrowedWeights, DiskWeights


def test_borrowed_tensor_is_the_models_frozen_base_weight(make_cfg, tiny_model_path):
    cfg = make_cfg()
    probe = build_policy(cfg, DiskWeights(tiny_model_path))
    name = "model.layers.0.self_attn.q_proj.weight"
    shape, dtype = probe.causal_lm.get_parameter(name).shape, probe.dtype
    # lent where the trainer computes, as a co-located engine does
    borrowed = torch.full(shape, 0.01, dtype=dtype, device=probe.device)
    policy = build_policy(cfg, BorrowedWeights(tiny_model_path, {name: borrowed}))
    q_proj = policy.causal_lm.get_submodule("model.layers.0.self_attn.q_proj")
    base_weight = q_proj.base_layer.weight  # LoRA wraps the HF linear
    assert base_weight.data_ptr() == borrowed.data_ptr()
    assert not base_weight.requires_grad


@pytest.mark.parametrize("engine_compiled", [True, False])
def test_bf16_borrowed_base_rounds_as_the_engine_it_borrows_from(make_cfg, tiny_model_path, engine_compiled):
    """Only the compiled engine fuses SiLU-and-mul into one rounding (grpo.trainer.hf.vllm_numerics)."""
    from safetensors.torch import load_file

    device = str(resolve_device(make_cfg()))  # lent where the trainer computes
    weights = {
        k: v.bfloat16() for k, v in load_file(str(tiny_model_path / "model.safetensors"), device).items()
    }
    source = BorrowedWeights(tiny_model_path, weights, engine_compiled=engine_compiled)
    policy = build_policy(make_cfg(), source)
    assert "forward" in vars(policy.causal_lm.model.layers[0].self_attn)
    assert ("forward" in vars(policy.causal_lm.model.layers[0].mlp)) == engine_compiled


def test_borrowed_tensor_on_another_device_is_refused_rather_than_copied(make_cfg, tiny_model_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    elsewhere = torch.zeros(128, 128, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="lends its base weights on meta but the trainer computes on"):
        build_policy(make_cfg(), BorrowedWeights(tiny_model_path, {name: elsewhere}))


def test_a_quantized_borrowed_weight_on_another_device_is_refused_too(make_cfg, tiny_model_path):
    from grpo.trainer.quantized_weights import FP8BlockWeight

    weight = torch.zeros(128, 128, dtype=torch.float8_e4m3fn, device="meta")
    elsewhere = FP8BlockWeight(weight, torch.ones(1, 1, device="meta"))
    source = BorrowedWeights(tiny_model_path, {}, {"model.layers.0.self_attn.q_proj": elsewhere})
    with pytest.raises(ValueError, match="lends its base weights on meta but the trainer computes on"):
        build_policy(make_cfg(), source)


def test_borrowed_tensor_of_wrong_dtype_is_rejected(make_cfg, tiny_model_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    wrong = torch.zeros(128, 128, dtype=torch.float64)
    with pytest.raises(ValueError, match="trainer's dtype"):
        build_policy(make_cfg(), BorrowedWeights(tiny_model_path, {name: wrong}))


def test_lora_trains_only_adapters_and_all_linear_covers_mlp(make_cfg, tiny_model_path):
    policy = build_policy(make_cfg(lora_target_modules=["all-linear"]), DiskWeights(tiny_model_path))
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any("down_proj" in n for n in names) and any("q_proj" in n for n in names)
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())


def test_full_training_trains_every_parameter_in_fp32(make_cfg, tiny_model_path):
    policy = build_policy(make_cfg(lora=False), DiskWeights(tiny_model_path))
    params = list(policy.model.parameters())
    assert all(p.requires_grad and p.dtype == torch.float32 for p in params)


def test_qlora_bnb_builds_nf4_base_with_lora_on_cpu(make_cfg, tiny_model_path):
    bnb = pytest.importorskip("bitsandbytes")

    policy = build_policy(make_cfg(qlora_bnb=True), DiskWeights(tiny_model_path))
    q_proj = policy.causal_lm.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit)
    assert q_proj.base_layer.weight.quant_state.quant_type == "nf4"


@pytest.mark.parametrize(
    "overrides, needed",
    [
        ({"qlora_fp4": True}, "SM100"),
    ],
)
def test_low_precision_formats_fail_at_start_without_a_capable_gpu(
    make_cfg, tiny_model_path, overrides, needed
):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only failure message")
    with pytest.raises(ValueError, match=needed):
        build_policy(make_cfg(**overrides), DiskWeights(tiny_model_path))


def test_qlora_fp8_is_weight_only_and_builds_without_an_fp8_gpu(make_cfg, tiny_model_path):
    from grpo.trainer.hf.quantized_base import quantized_linear_class

    policy = build_policy(make_cfg(qlora_fp8=True), DiskWeights(tiny_model_path))
    q_proj = policy.causal_lm.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj.base_layer, quantized_linear_class())
    assert q_proj.base_layer.weight.dtype == torch.float8_e4m3fn


def test_trainer_quantization_is_refused_on_borrowed_weights(make_cfg, tiny_model_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    cfg = make_cfg(qlora_fp8=True)
    borrowed = BorrowedWeights(tiny_model_path, {name: torch.zeros(128, 128)})
    with pytest.raises(ValueError, match="turn the trainer's quantization off"):
        build_policy(cfg, borrowed)
