"""Dequantize borrowed base weights on the fly for the trainer's forward and backward.

The engine keeps its base weights quantized; the trainer must not keep a bf16 copy (that is the
memory co-location saves). `DequantLinear` dequantizes into a buffer shared by all layers in
forward, and again in backward, so at most one layer's bf16 weight exists at a time.

The formats: grpo.trainer.quantized_weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo.trainer.quantized_weights import FP8BlockWeight, NF4Weight

if TYPE_CHECKING:
    import torch


def nf4_absmax(weight: NF4Weight) -> torch.Tensor:
    import torch

    if weight.nested_absmax is None:
        return weight.absmax.float()
    assert weight.nested_code is not None
    codes = weight.nested_code[weight.absmax.long()]
    scale = weight.nested_absmax.repeat_interleave(weight.nested_blocksize)[: codes.numel()]
    return (codes * scale + weight.offset).to(torch.float32)


def dequantize_nf4(weight: NF4Weight, out: torch.Tensor | None = None, dtype: Any = None) -> torch.Tensor:
    """[out, in] weight in `dtype` (default bf16), written into `out` when given."""
    import torch

    dtype = dtype or torch.bfloat16
    packed = weight.packed.reshape(-1)
    codes = torch.stack(((packed >> 4) & 0xF, packed & 0xF), dim=1).reshape(-1)
    values = weight.code.float()[codes.long()]
    absmax = nf4_absmax(weight).repeat_interleave(weight.blocksize)[: values.numel()]
    result = (values * absmax).reshape(weight.shape)
    if out is None:
        return result.to(dtype)
    return out.copy_(result)


DEQUANT_CHUNK_BYTES = 64 * 2**20
"""The fp32 temporary one FP8 dequantization holds at most: rows are dequantized a chunk at a time,
so a per-tensor scale (one tile as large as the whole weight) never expands to a full matrix."""


def fp8_chunk_rows(num_cols: int) -> int:
    """Rows of a [rows, num_cols] FP8 weight dequantized at a time (fp32 chunk <= DEQUANT_CHUNK_BYTES)."""
    return max(1, DEQUANT_CHUNK_BYTES // (4 * num_cols))


def dequantize_fp8_block(
    weight: FP8BlockWeight, out: torch.Tensor | None = None, dtype: Any = None
) -> torch.Tensor:
    """[out, in] weight in `dtype` (default bf16), written into `out` when given: fp8 x its tile's
    scale in fp32, rounded once to the output dtype. The only temporaries are one chunk of rows in
    fp32 (fp8_chunk_rows) and its rows' scales [chunk, column tiles]."""
    import torch

    rows, cols = weight.weight.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=dtype or torch.bfloat16, device=weight.weight.device)
    block = weight.block
    num_whole = cols // block  # column tiles that lie whole inside the weight
    step = fp8_chunk_rows(cols)
    # One float32 buffer for every chunk: a fresh chunk per iteration is allocated while the previous
    # one is still referenced, which held two chunks at once on CUDA (measured on an H200).
    buffer = torch.empty((min(step, rows), cols), dtype=torch.float32, device=weight.weight.device)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        tiles = torch.arange(weight.row_offset + start, weight.row_offset + stop, device=weight.scale.device)
        scale = weight.scale[tiles // block].float()  # [chunk, column tiles]
        chunk = buffer[: stop - start]
        chunk.copy_(weight.weight[start:stop])
        chunk[:, : num_whole * block].unflatten(1, (num_whole, block)).mul_(scale[:, :num_whole, None])
        if num_whole * block < cols:  # the last column tile, cut short by the weight's edge
            chunk[:, num_whole * block :].mul_(scale[:, num_whole : num_whole + 1])
        out[start:stop].copy_(chunk)
    return out


class DequantBuffers:
    """One reusable buffer per (shape, dtype, device), shared by every layer of the trainer."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def get(self, shape: tuple[int, int], dtype: Any, device: Any) -> torch.Tensor:
        import torch

        key = (shape, dtype, str(device))
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return self._buffers[key]


def dequant_linear(
    x: torch.Tensor, quantized: NF4Weight | FP8BlockWeight, buffers: DequantBuffers
) -> torch.Tensor:
    """y = x @ W^T with W dequantized into a shared buffer in forward and again in backward."""
    return _DequantLinearFn.apply(x, quantized, buffers)


def _dequantize_into(
    quantized: NF4Weight | FP8BlockWeight, buffers: DequantBuffers, like: torch.Tensor
) -> torch.Tensor:
    buf = buffers.get(quantized.shape, like.dtype, like.device)
    if isinstance(quantized, NF4Weight):
        return dequantize_nf4(quantized, out=buf)
    return dequantize_fp8_block(quantized, out=buf)


def _make_fn() -> Any:
    import torch

    class DequantLinearFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, quantized: Any, buffers: DequantBuffers) -> torch.Tensor:
            ctx.quantized, ctx.buffers = quantized, buffers
            weight = _dequantize_into(quantized, buffers, x)
            return x @ weight.t()

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            # The base weight is frozen: only the input gradient is needed, and the buffer may
            # hold another layer's weight by now, so dequantize again.
            weight = _dequantize_into(ctx.quantized, ctx.buffers, grad_out)
            return grad_out @ weight, None, None

    return DequantLinearFn


class _LazyFn:
    _fn: Any = None

    def apply(self, *args: Any) -> Any:
        if self._fn is None:
            self._fn = _make_fn()
        return self._fn.apply(*args)


_DequantLinearFn = _LazyFn()
