"""Frozen base linears that keep only quantized weights and dequantize them per matmul.

`QuantizedLinear` replaces a decoder layer's `nn.Linear` once the model is loaded. It holds the
quantized data (FP8 E4M3 + 128x128 block scales, or NF4 borrowed from an engine) as buffers and
no dense weight; each forward and backward dequantizes into one buffer shared by every layer
(grpo.trainer.hf.dequant), so the trainer never holds more than one layer's dense weight.

It subclasses `nn.Linear` so PEFT's default LoRA dispatch wraps it like any linear. PEFT reads
`weight` (device, sharding) and the adapters' dtype from `compute_dtype`. As in bitsandbytes'
Linear4bit, `weight` holds the quantized codes (float8_e4m3fn, or packed uint8 for NF4), not
values: the real weight is `weight * weight_scale` per tile. FP8 tensors support almost no
arithmetic in torch, so code that mistakes them for dense values fails loudly.

Weight-only: matmuls run in `compute_dtype` (bf16 or fp32) after dequantization, never as FP8
matmuls, so any CPU or CUDA GPU can train on FP8 base weights.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeAlias

from grpo.models.shape import LINEAR_MODULES
from grpo.trainer.hf.dequant import DequantBuffers, dequant_linear
from grpo.trainer.quantized_weights import FP8BlockWeight, NF4Weight
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch import nn

FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0
# Buffer names of quantized fields; the codes are `weight`, where PEFT looks for the base layer's device.
_BUFFER_NAMES = {"weight": "weight", "packed": "weight", "scale": "weight_scale"}

QuantizedWeight: TypeAlias = NF4Weight | FP8BlockWeight


def quantize_fp8_block(weight: torch.Tensor, block: int = FP8_BLOCK) -> FP8BlockWeight:
    """[out, in] weight -> float8_e4m3fn data + one fp32 scale per [block x block] tile.

    The scale maps each tile's largest magnitude to E4M3's largest finite value (448), so no
    value saturates and real = fp8 * scale.
    """
    import torch

    rows, cols = weight.shape
    num_row_tiles, num_col_tiles = -(-rows // block), -(-cols // block)
    # Zero padding to whole tiles leaves each tile's amax unchanged.
    padded = torch.nn.functional.pad(
        weight.detach().float(), (0, num_col_tiles * block - cols, 0, num_row_tiles * block - rows)
    )
    tiles = padded.view(num_row_tiles, block, num_col_tiles, block)  # [R/b, b, C/b, b]
    amax = tiles.abs().amax(dim=(1, 3))  # [R/b, C/b]
    # An all-zero tile gets scale 1 (any scale represents zeros exactly).
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scaled = (tiles / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    codes = scaled.view(num_row_tiles * block, num_col_tiles * block)[:rows, :cols]
    return FP8BlockWeight(codes.to(torch.float8_e4m3fn).contiguous(), scale.contiguous(), block)


def _make_quantized_linear_class() -> Any:
    import torch
    from torch import nn

    class QuantizedLinear(nn.Linear):
        """A frozen linear whose weight exists only quantized (see the module docstring)."""

        def __init__(
            self,
            quantized: QuantizedWeight,
            bias: torch.Tensor | None,
            compute_dtype: torch.dtype,
            buffers: DequantBuffers,
        ) -> None:
            # nn.Module.__init__, not nn.Linear's: that would allocate the dense weight this class avoids.
            nn.Module.__init__(self)
            out_features, in_features = quantized.shape
            self.in_features, self.out_features = in_features, out_features
            self.compute_dtype = compute_dtype
            self.dequant_buffers = buffers
            self._format = type(quantized)
            self._static_fields: dict[str, Any] = {}
            self._buffer_of_field: dict[str, str] = {}
            for field in dataclasses.fields(quantized):
                value = getattr(quantized, field.name)
                if isinstance(value, torch.Tensor):
                    buffer_name = _BUFFER_NAMES.get(field.name, field.name)
                    # Not persistent: the base is never saved (adapters are), and a state dict with
                    # FP8 codes under a weight-like name would mislead whoever loads it.
                    self.register_buffer(buffer_name, value, persistent=False)
                    self._buffer_of_field[field.name] = buffer_name
                else:
                    self._static_fields[field.name] = value
            self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

        @property
        def quantized(self) -> QuantizedWeight:
            """The quantized weight over this module's current buffers (they follow `.to(device)`)."""
            tensors = {field: getattr(self, name) for field, name in self._buffer_of_field.items()}
            weight: QuantizedWeight = self._format(**tensors, **self._static_fields)
            return weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = dequant_linear(x.to(self.compute_dtype), self.quantized, self.dequant_buffers)
            return out if self.bias is None else out + self.bias.to(out.dtype)

        def extra_repr(self) -> str:
            return (
                f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self._format.__name__}, compute_dtype={self.compute_dtype}"
            )

    return QuantizedLinear


_quantized_linear_class: Any = None


def quantized_linear_class() -> type[nn.Linear]:
    """The `QuantizedLinear` class (built on first use: torch is imported lazily)."""
    global _quantized_linear_class
    if _quantized_linear_class is None:
        _quantized_linear_class = _make_quantized_linear_class()
    cls: type[nn.Linear] = _quantized_linear_class
    return cls


def make_quantized_linear(
    quantized: QuantizedWeight,
    bias: torch.Tensor | None,
    compute_dtype: torch.dtype,
    buffers: DequantBuffers,
) -> nn.Linear:
    module: nn.Linear = quantized_linear_class()(quantized, bias, compute_dtype, buffers)
    return module


def decoder_linear_names(model: nn.Module) -> list[str]:
    """Names of the decoder layers' base linear modules (q/k/v/o and the MLP), in model order.

    Under PEFT these are the `...q_proj.base_layer` modules the LoRA layers wrap.
    """
    from torch import nn

    names = []
    for name, module in model.named_modules():
        path = name.removesuffix(".base_layer")
        if ".layers." in path and path.rpartition(".")[2] in LINEAR_MODULES and isinstance(module, nn.Linear):
            names.append(name)
    return names


def replace_linears(
    model: nn.Module,
    quantized: dict[str, QuantizedWeight],
    compute_dtype: torch.dtype,
    buffers: DequantBuffers | None = None,
) -> None:
    """Swap each named linear of `model` for a `QuantizedLinear` over `quantized[name]`.

    The old module (and its dense weight, unless referenced elsewhere) is released as it is
    swapped. All swapped layers share `buffers` (one dense buffer per weight shape).
    """
    buffers = buffers or DequantBuffers()
    for name, weight in quantized.items():
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child_name)
        if tuple(old.weight.shape) != tuple(weight.shape):
            raise ValueError(
                f"quantized weight for {name} is {tuple(weight.shape)}, the model's linear is {tuple(old.weight.shape)}; "
                "the quantized weights belong to another model"
            )
        setattr(parent, child_name, make_quantized_linear(weight, old.bias, compute_dtype, buffers))


def quantize_base_linears_fp8(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Quantize every decoder-layer linear of `model` to FP8 block-scaled, in place; returns the count."""
    names = decoder_linear_names(model)
    if not names:
        raise UserError(
            "qlora_fp8 found no decoder-layer linear modules (q_proj ... down_proj) to quantize; "
            "this model architecture is not supported by qlora_fp8, use qlora_bnb"
        )
    buffers = DequantBuffers()
    for name in names:
        # One at a time: the dense weight of a layer is freed as soon as its FP8 copy replaces it.
        weight = model.get_submodule(name).weight
        replace_linears(model, {name: quantize_fp8_block(weight)}, compute_dtype, buffers)
    return len(names)


def base_linear_bytes(model: nn.Module) -> int:
    """Bytes held by the decoder linears' base storage (dense weights, or quantized data + scales)."""
    total = 0
    for name in decoder_linear_names(model):
        module = model.get_submodule(name)
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not module.bias)
    return total
