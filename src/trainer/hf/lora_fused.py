"""A float32 LoRA linear layer as one autograd step: no [tokens, out] temporaries beyond the output.

peft's lora.Linear computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`: the adapter's
[tokens, out] product is scaled and then added to the base output, two more passes over a
[tokens, out] tensor in forward and two more (the scale's and the add's gradients) in backward,
for every adapted projection of every layer. Here the scale moves to the [tokens, r] side and the
adapter's product accumulates into the base output in place (addmm); backward computes the same
four products peft's autograd does and accumulates the input's two gradients in place too.
Measured on 2 AVX2 cores while other work loaded them, one 576 -> 1536 projection at r 16 over
1,760 tokens, forward and backward, 20 of each in turns: 250 ms with peft's forward against 211 ms,
with the same values and gradients bit for bit. In a whole model the outputs stay equal and the
gradients agree to float32 rounding: a hidden state feeding several projections (q, k, v) gets its
gradient's terms summed in another order. A whole short-answer trainer step (embedded model, 8
prompt trees, 1,760 tokens; benchmarks/trainer_paths_bench.py, 5 rounds, medians): 13.64 s with
peft's forward, 13.36 with this one; 12.73 and 11.63 with the loss tokens' probabilities kept
(grpo.trainer.fused_logprobs). The machine's spread between steps is about 10%: a 3-round run gave
12.56 / 12.30 / 12.54 / 12.37.

Two kinds of layer take this path: float32 ones (x, base weight and adapter weights all float32,
autocast off), where a power-of-two scaling (alpha / r = 2 by default) keeps each product exact;
and a 16-bit base under autocast in its dtype (grpo's bf16 policy: float32 adapters, activations
and base weights bf16), where the fused step rounds exactly where autocast rounds peft's forward:
the adapter weights cast to the 16-bit dtype, each product rounded, the scaled adapter output
rounded, then the sum; backward likewise, the adapters' gradients handed back in float32 as
autocast's casts do; a power-of-two scale (the default) is applied on the [tokens, r] side, which
rounds the same. There the saving is the work around small products: peft's layer costs two
weight casts, a scale and an add over [tokens, out], and eight autograd nodes per call. A bf16
trainer step on a real short-answer batch (embedded model, 64 rollouts, ~1,100 loss tokens, all
linears adapted at r 16) on 2 AVX512-BF16 cores, 6 steps each way in turns in one process: 5.13 s
fastest / 5.63 s median against 5.59 / 5.90 with peft's forward. Outputs equal peft's bit for bit;
the gradients of a hidden state feeding q, k and v are summed in another order, so the adapters'
gradients agree to the 16-bit rounding of those sums.

Everything else keeps peft's forward: a disabled or merged adapter, dropout, a variant (DoRA),
several active adapters, quantized base layers, a 16-bit layer without autocast or a float32
layer under it: each call checks, since peft toggles adapters on the module at run time (the
reference model's `disable_adapter`).
"""

from __future__ import annotations

import math
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

_FUNCTION: Any = None


def fuse_lora_linears(model: nn.Module) -> None:
    """Give each peft lora.Linear over a plain nn.Linear the fused forward (it falls back to peft's
    own per call wherever it does not apply)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from torch import nn

    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is nn.Linear:
            module.forward = types.MethodType(_make_forward(module.forward), module)


def _make_forward(peft_forward: Any) -> Any:
    def forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapter = _fusable_adapter(self, x, args, kwargs)
        if adapter is None:
            return peft_forward(x, *args, **kwargs)
        base = self.base_layer
        return _function().apply(
            x,
            base.weight,
            base.bias,
            self.lora_A[adapter].weight,
            self.lora_B[adapter].weight,
            float(self.scaling[adapter]),
        )

    return forward


def _fusable_adapter(
    layer: Any, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """The one active adapter's name when the fused path computes what peft's forward would."""
    import torch
    from torch import nn

    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A or active[0] in layer.lora_variant:
        return None
    adapter = active[0]
    if not isinstance(layer.lora_dropout[adapter], nn.Identity):
        return None
    lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
    if lora_a.bias is not None or lora_b.bias is not None:
        return None
    base = layer.base_layer
    adapters_float32 = lora_a.weight.dtype == lora_b.weight.dtype == torch.float32
    if torch.is_autocast_enabled(x.device.type):
        # the 16-bit path: x and the base already in autocast's dtype, so autocast casts only the adapters
        dtype = torch.get_autocast_dtype(x.device.type)
        same = x.dtype == base.weight.dtype == dtype and (base.bias is None or base.bias.dtype == dtype)
        return adapter if same and dtype in (torch.bfloat16, torch.float16) and adapters_float32 else None
    return adapter if adapters_float32 and x.dtype == base.weight.dtype == torch.float32 else None


def _power_of_two(scaling: float) -> bool:
    """Whether multiplying by `scaling` only shifts exponents, exact short of overflow (alpha / r = 2
    by default)."""
    return scaling > 0 and math.frexp(scaling)[0] == 0.5


def _function() -> Any:
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _build()
    return _FUNCTION


def _build() -> Any:
    import torch
    from torch.autograd.function import once_differentiable

    class LoraLinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any,
            x: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None,
            lora_a: torch.Tensor,
            lora_b: torch.Tensor,
            scaling: float,
        ) -> torch.Tensor:
            """x [..., in], weight [out, in], bias [out], lora_a [r, in], lora_b [out, r] -> [..., out]

            x and weight in one dtype; lora_a and lora_b float32, cast to it where it is 16-bit."""
            x2 = x.reshape(-1, x.shape[-1])  # [T, in]
            with torch.autocast(x.device.type, enabled=False):
                out = x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())  # [T, out]
                if x.dtype == torch.float32:
                    after_a = x2 @ lora_a.t()  # [T, r]
                    out.addmm_(after_a, lora_b.t(), alpha=scaling)
                else:  # autocast's roundings: each product, then the scaled adapter output, then the sum
                    lora_a, lora_b = lora_a.to(x.dtype), lora_b.to(x.dtype)
                    after_a = x2 @ lora_a.t()  # [T, r]
                    if _power_of_two(scaling):
                        # scaling a rounded value by 2^k is exact, so scaling the [T, r] side gives
                        # the same bits as scaling the rounded [T, out] product: one pass fewer
                        after_a = after_a.mul_(scaling)
                        out.add_(after_a @ lora_b.t())
                    else:
                        out.add_((after_a @ lora_b.t()).mul_(scaling))
            ctx.save_for_backward(x2, weight, lora_a, lora_b, after_a)
            ctx.scaling = scaling
            return out.view(*x.shape[:-1], out.shape[-1])

        @staticmethod
        @once_differentiable
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            # lora_a/lora_b as forward multiplied them: float32, or cast to the 16-bit dtype
            x2, weight, lora_a, lora_b, after_a = ctx.saved_tensors
            with torch.autocast(grad_out.device.type, enabled=False):
                return _backward(ctx, grad_out, x2, weight, lora_a, lora_b, after_a)

    def _backward(
        ctx: Any,
        grad_out: torch.Tensor,
        x2: torch.Tensor,
        weight: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        after_a: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        grad = grad_out.reshape(-1, grad_out.shape[-1])  # [T, out]
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if x2.dtype == torch.float32:
            grad_after_a = (grad @ lora_b).mul_(ctx.scaling)  # [T, r]
            if need_b:
                grad_b = (grad.t() @ after_a).mul_(ctx.scaling)  # [out, r]
        elif _power_of_two(ctx.scaling):
            # autograd's order under autocast (below) with the exact 2^k scale moved to the [T, r]
            # side; forward saved after_a already scaled
            grad_after_a = (grad @ lora_b).mul_(ctx.scaling)  # [T, r]
            if need_b:
                grad_b = (grad.t() @ after_a).float()  # [out, r]
        else:  # autograd's order under autocast: the scale's gradient rounded first
            grad_scaled = grad * ctx.scaling  # [T, out]
            grad_after_a = grad_scaled @ lora_b  # [T, r]
            if need_b:
                grad_b = (grad_scaled.t() @ after_a).float()  # [out, r]
        if need_x:
            grad_x = grad @ weight  # [T, in]
            if x2.dtype == torch.float32:
                grad_x.addmm_(grad_after_a, lora_a)
            else:
                grad_x.add_(grad_after_a @ lora_a)
            grad_x = grad_x.view(*grad_out.shape[:-1], x2.shape[-1])
        if need_w:
            grad_w = grad.t() @ x2
        if need_bias:  # never set for a None bias
            grad_bias = grad.sum(0)
        if need_a:
            grad_a = (grad_after_a.t() @ x2).float()  # [r, in]
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None

    return LoraLinearFunction
