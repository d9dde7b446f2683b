"""`recipe: fp8_hybrid`: which linears multiply in FP8, and that they compute what the recipe says
(E4M3 inputs and weights forward, E5M2 output gradients backward, one dynamic scale per tensor),
checked against an emulation of each matmul on tiny shapes (torch's FP8 casts and scaled matmuls
run on a CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpo.trainer.hf.fp8_training import convert_to_fp8_hybrid, is_fp8_target
from grpo.utils.errors import UserError


def _quantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t cast to `dtype` under one scale mapping its amax to the format's largest value, and back."""
    scale = torch.finfo(dtype).max / t.abs().max().float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(
        dtype
    ).float() / scale


class _Decoder(nn.Module):
    """A decoder's module names: layers.N.{proj}, an embedding and an lm_head."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"up_proj": nn.Linear(dim, 2 * dim, bias=False), "odd": nn.Linear(dim, 24)})
            for _ in range(2)
        )
        self.lm_head = nn.Linear(dim, 32, bias=False)


def test_the_decoder_layers_linears_convert_and_the_head_and_odd_shapes_do_not():
    from torchao.float8.float8_linear import Float8Linear

    model = _Decoder()
    weight = model.layers[0]["up_proj"].weight
    assert convert_to_fp8_hybrid(model) == 2
    converted = model.layers[0]["up_proj"]
    assert type(converted) is Float8Linear and converted.weight is weight  # the same tensor, not a copy
    assert type(model.layers[1]["odd"]) is nn.Linear  # 24 outputs: not a multiple of 16
    assert type(model.lm_head) is nn.Linear
    assert not is_fp8_target("base_model.model.layers.0.q_proj.lora_A.default", nn.Linear(64, 16))
    assert not is_fp8_target("model.visual.blocks.0.attn.qkv", nn.Linear(64, 64))


def test_a_model_without_a_convertible_linear_is_refused():
    with pytest.raises(UserError, match="fp8_hybrid found no decoder linear layer"):
        convert_to_fp8_hybrid(nn.Sequential(nn.Linear(64, 64)))


def test_forward_and_backward_are_the_matmuls_of_the_e4m3_and_e5m2_casts():
    torch.manual_seed(0)
    model = _Decoder()
    convert_to_fp8_hybrid(model)
    linear = model.layers[0]["up_proj"]
    x = (torch.randn(8, 64) * 3).requires_grad_()
    grad_out = torch.randn(8, 128) * 1e-3  # a gradient's scale: E5M2's range matters, not E4M3's
    y = linear(x)
    y.backward(grad_out)

    w = linear.weight.detach()
    x_q, w_q = _quantized(x.detach(), torch.float8_e4m3fn), _quantized(w, torch.float8_e4m3fn)
    g_q = _quantized(grad_out, torch.float8_e5m2)
    torch.testing.assert_close(y.detach(), x_q @ w_q.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, g_q @ w_q, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(linear.weight.grad, g_q.T @ x_q, atol=1e-7, rtol=1e-5)
    # The emulation tells the formats apart: E4M3 gradients would be another result.
    g_e4m3 = _quantized(grad_out, torch.float8_e4m3fn)
    assert not torch.allclose(x.grad, g_e4m3 @ w_q, atol=1e-7, rtol=1e-5)
    # And FP8 is not the float32 matmul it stands in for (the recipe is lossy, within a few %).
    exact = x.detach() @ w.T
    relative = (y.detach() - exact).norm() / exact.norm()
    assert 1e-4 < relative < 0.1


def test_lora_over_an_fp8_base_trains_the_adapters_in_float32():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = _Decoder()
    convert_to_fp8_hybrid(model)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["up_proj"]))
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    layer = peft_model.base_model.model.layers[0]["up_proj"]
    # PEFT wraps the Float8Linear; B starts at zero, so give it a value to see its gradient flow.
    nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    x = torch.randn(8, 64)
    layer(x).square().sum().backward()
    assert layer.lora_A["default"].weight.grad.abs().sum() > 0
    assert layer.base_layer.weight.grad is None  # the frozen base gets no gradient


@pytest.mark.gpu
def test_an_fp8_hybrid_lora_policy_learns_on_an_sm89_gpu_as_its_bf16_twin_does(tiny_model_path):
    """build_policy with the recipe on the GPU: every decoder linear multiplies in FP8 under its
    adapter, the first logprobs are the bf16 policy's within FP8's error, and 30 AdamW steps
    lower the loss about as far."""
    from torchao.float8.float8_linear import Float8Linear

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.model import build_policy
    from grpo.trainer.weights import DiskWeights

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("recipe fp8_hybrid needs SM89+")
    input_ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()

    def losses(recipe: str) -> list[float]:
        cfg = TrainerConfig(model=str(tiny_model_path), recipe=recipe, learning_rate=1e-3)
        policy = build_policy(cfg, DiskWeights(tiny_model_path))
        num_fp8 = sum(type(m) is Float8Linear for m in policy.model.modules())
        assert num_fp8 == (14 if recipe == "fp8_hybrid" else 0)  # 2 layers x q, k, v, o, gate, up, down
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
        out = []
        for _ in range(30):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = policy.model(input_ids=input_ids).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    fp8, bf16 = losses("fp8_hybrid"), losses("bf16")
    assert abs(fp8[0] - bf16[0]) < 0.02 * bf16[0]
    assert fp8[-1] < fp8[0] - 0.5 * (bf16[0] - bf16[-1])
