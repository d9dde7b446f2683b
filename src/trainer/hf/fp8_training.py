"""`recipe: fp8_hybrid`: the decoder's linear layers multiply in FP8, through torchao's float8 training.

Each converted linear casts its input and weight to float8_e4m3fn for the forward matmul and its
output gradient to float8_e5m2 for the two backward matmuls (E4M3 keeps more mantissa for values,
E5M2 more range for gradients: the "hybrid" of the recipe's name), each with one dynamic scale per
tensor (the amax of the tensor as it is now, no history), and accumulates in float32 on the tensor
cores. The stored weights do not change: LoRA keeps its 16-bit base and float32 adapters (the base's
matmuls run in FP8, the adapters' in high precision), full training its float32 master weights and
optimizer state under bf16 autocast. The lm_head stays in high precision: the logprobs the loss
and the mismatch KL read come from it.

torchao's casts and scaled matmuls also run on a CPU (torch._scaled_mm has a CPU kernel), which is
how tests/trainer/hf/test_fp8_training.py pins the numerics against an emulation; the trainer
itself refuses the recipe off an SM89+ GPU (grpo.trainer.device), where the tensor cores that
make it worth doing are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    from torch import nn

FP8_ALIGNMENT = 16
"""torch._scaled_mm needs both dimensions of an FP8 weight to be multiples of 16."""


def fp8_hybrid_config() -> Any:
    """torchao's Float8LinearConfig for the recipe: E4M3 input and weight, E5M2 output gradient,
    dynamic tensorwise scales."""
    import torch

    try:
        from torchao.float8 import CastConfig, Float8LinearConfig, ScalingGranularity, ScalingType
    except ImportError as err:
        raise UserError(
            "recipe fp8_hybrid needs torchao (pip install 'torchao>=0.18,<0.19'); or set recipe: bf16"
        ) from err

    def cast(dtype: torch.dtype) -> Any:
        return CastConfig(
            scaling_type=ScalingType.DYNAMIC,
            scaling_granularity=ScalingGranularity.TENSORWISE,
            target_dtype=dtype,
        )

    e4m3 = cast(torch.float8_e4m3fn)
    return Float8LinearConfig(
        cast_config_input=e4m3,
        cast_config_weight=e4m3,
        cast_config_grad_output=cast(torch.float8_e5m2),
    )


def is_fp8_target(name: str, module: nn.Module) -> bool:
    """A decoder layer's linear whose shape FP8 matmuls take; never the lm_head, a vision tower or a
    LoRA adapter (rank-sized, and trained in float32)."""
    from torch import nn

    if type(module) is not nn.Linear or ".layers." not in f".{name}":
        return False
    if "lora_" in name or "visual" in name or "vision" in name:
        return False
    return module.in_features % FP8_ALIGNMENT == 0 and module.out_features % FP8_ALIGNMENT == 0


def convert_to_fp8_hybrid(causal_lm: nn.Module) -> int:
    """Swap the decoder's linears for torchao Float8Linear in place (same weight tensors); return
    how many were converted. Call before LoRA wraps them."""
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    config = fp8_hybrid_config()
    targets = [name for name, module in causal_lm.named_modules() if is_fp8_target(name, module)]
    if not targets:
        raise UserError(
            "recipe fp8_hybrid found no decoder linear layer with both dimensions a multiple of 16 "
            "(what FP8 matmuls take); set recipe: bf16"
        )
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = causal_lm.get_submodule(parent_name)
        linear = getattr(parent, child)
        assert isinstance(linear, nn.Linear)
        setattr(parent, child, Float8Linear.from_float(linear, config=config))
    return len(targets)
