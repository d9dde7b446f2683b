"""Quantized base weights as they are handed to the trainer (by the co-located engine, or built by
qlora_fp8): the codes and scales, by format. Dequantizing them is the HF backend's
(grpo.trainer.hf.dequant).

Formats:
- NF4 (bitsandbytes): two 4-bit codes per byte (first element in the high nibble), one absmax per
  block of `blocksize` elements; with double quantization the absmax values are themselves
  8-bit blockwise-quantized (code book + per-block absmax) plus an offset.
- FP8 E4M3 with block scales: weight [out, in] in float8_e4m3fn, one fp32 scale per
  [block x block] tile (scale_inv convention: real = fp8 * scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class NF4Weight:
    packed: torch.Tensor
    """uint8, numel = out*in/2 (any shape; read flat)."""
    absmax: torch.Tensor
    """fp32 [num_blocks], or uint8 [num_blocks] when double-quantized."""
    code: torch.Tensor
    """fp32 [16] NF4 code book."""
    blocksize: int
    shape: tuple[int, int]
    nested_absmax: torch.Tensor | None = None
    """fp32 per-block absmax of the quantized absmax (double quantization)."""
    nested_code: torch.Tensor | None = None
    """fp32 [256] code book of the quantized absmax."""
    nested_blocksize: int = 256
    offset: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.packed.device


@dataclass
class FP8BlockWeight:
    weight: torch.Tensor
    """float8_e4m3fn [out, in]."""
    scale: torch.Tensor
    """fp32 [ceil((row_offset + out)/block), ceil(in/block)]."""
    block: int = 128
    row_offset: int = 0
    """Rows of the first scale tile above `weight` (0 <= row_offset < block): a q/k/v part of a fused
    weight can start mid-tile, and then shares that tile's scale with the part before it."""

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the dequantized weight (like NF4Weight.shape)."""
        rows, cols = self.weight.shape
        return (rows, cols)

    @property
    def device(self) -> torch.device:
        return self.weight.device
