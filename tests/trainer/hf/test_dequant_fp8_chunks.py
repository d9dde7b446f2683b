"""FP8 dequantization a chunk of rows at a time: bit for bit the whole-matrix reference, and no
temporary above the chunk bound (a per-tensor scale once expanded to rows x max(out, in) floats)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo.trainer.hf import dequant
from grpo.trainer.hf.dequant import DEQUANT_CHUNK_BYTES, dequantize_fp8_block, fp8_chunk_rows
from grpo.trainer.quantized_weights import FP8BlockWeight


def _reference(weight: FP8BlockWeight) -> torch.Tensor:
    """fp8 x its tile's scale in fp32, the scale expanded to every element (whole matrix)."""
    rows, cols = weight.weight.shape
    tile_rows = (torch.arange(rows) + weight.row_offset) // weight.block
    tile_cols = torch.arange(cols) // weight.block
    return weight.weight.float() * weight.scale.float()[tile_rows[:, None], tile_cols[None, :]]


def _fp8(rows: int, cols: int, seed: int) -> torch.Tensor:
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 100
    # Within E4M3's range: out-of-range values become NaN on some CPUs and saturate on others (seen
    # on an Intel Xeon vs an AMD EPYC), and NaN != NaN would fail the bit-for-bit comparison.
    return values.clamp(-448, 448).to(torch.float8_e4m3fn)


def _block_weight(rows: int, cols: int, row_offset: int, seed: int) -> FP8BlockWeight:
    """Rows of a 128-tile block-scaled weight starting `row_offset` rows into their first tile."""
    scale = torch.rand(
        -(-(row_offset + rows) // 128), -(-cols // 128), generator=torch.Generator().manual_seed(seed)
    )
    return FP8BlockWeight(_fp8(rows, cols, seed), scale + 0.01, 128, row_offset=row_offset)


CASES = {
    "block-ragged-edges": lambda: _block_weight(300, 200, 0, seed=1),
    "block-part-starting-mid-tile": lambda: _block_weight(190, 384, 64, seed=2),
    # vLLM per-tensor FP8 (grpo.colocate.quantized_views): one tile as large as the whole weight.
    "per-tensor": lambda: FP8BlockWeight(_fp8(300, 200, 3), torch.tensor([[0.0173]]), 300),
    "per-tensor-square": lambda: FP8BlockWeight(_fp8(256, 256, 4), torch.tensor([[3.5]]), 256),
    "per-tensor-transposed-storage": lambda: FP8BlockWeight(
        _fp8(200, 300, 5).t(), torch.tensor([[0.25]]), 300
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_bytes", [DEQUANT_CHUNK_BYTES, 7 * 4 * 384, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_fp8_dequantization_equals_the_whole_matrix_reference_bit_for_bit(
    case: str, chunk_bytes: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 7 rows of 384 columns per chunk: chunk edges fall inside the 128-row tiles.
    monkeypatch.setattr(dequant, "DEQUANT_CHUNK_BYTES", chunk_bytes)
    weight = CASES[case]()
    got = dequantize_fp8_block(weight, dtype=dtype)
    assert got.dtype == dtype and got.shape == weight.shape
    assert torch.equal(got, _reference(weight).to(dtype))
    into = torch.full(weight.shape, float("nan"), dtype=dtype)
    assert dequantize_fp8_block(weight, out=into) is into and torch.equal(into, got)


class _LargestNewTensor(TorchDispatchMode):
    """Records the largest storage any op allocates, leaving out the ones `known` (inputs, output)."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for out in result if isinstance(result, tuple | list) else [result]:
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in self.known:
                self.largest = max(self.largest, out.untyped_storage().nbytes())
        return result


def test_a_per_tensor_weight_never_allocates_more_than_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    chunk_bytes = 256 * 1024
    monkeypatch.setattr(dequant, "DEQUANT_CHUNK_BYTES", chunk_bytes)
    rows, cols = 3000, 1000  # expanding the scale would take 3000 x 3000 fp32 = 36 MB
    weight = FP8BlockWeight(_fp8(rows, cols, 6), torch.tensor([[0.02]]), max(rows, cols))
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    with _LargestNewTensor([weight.weight, weight.scale, out]) as mode:
        dequantize_fp8_block(weight, out=out)
    assert 0 < mode.largest <= chunk_bytes
    assert torch.equal(out, _reference(weight).to(torch.bfloat16))


def test_a_7b_gate_projection_dequantizes_in_chunks_of_at_most_64_mib() -> None:
    # Qwen2-7B's gate_proj [18944, 3584]: a whole-matrix fp32 temporary would be 272 MB, and the
    # per-tensor scale expanded to 18944 x 18944 fp32 1.4 GB.
    rows = fp8_chunk_rows(3584)
    assert rows * 3584 * 4 <= DEQUANT_CHUNK_BYTES < (rows + 1) * 3584 * 4
    assert -(-18944 // rows) == 5  # chunks per dequantization of the whole weight
    assert fp8_chunk_rows(10**9) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("per_tensor", [True, False], ids=["per-tensor", "block"])
def test_fp8_dequantization_on_cuda_is_bit_exact_and_holds_one_chunk(per_tensor: bool) -> None:
    # A 7B gate projection's shape, the weight on the GPU as the engine's borrowed one would be.
    rows, cols = 18944, 3584
    fp8 = _fp8(rows, cols, 7)
    if per_tensor:
        weight = FP8BlockWeight(fp8, torch.tensor([[0.0173]]), max(rows, cols))
    else:
        weight = _block_weight(rows, cols, 0, seed=7)
        weight = FP8BlockWeight(fp8, weight.scale, 128)
    expected = dequantize_fp8_block(weight)  # on the CPU
    on_cuda = FP8BlockWeight(weight.weight.cuda(), weight.scale.cuda(), weight.block, weight.row_offset)
    out = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dequantize_fp8_block(on_cuda, out=out)
    torch.cuda.synchronize()
    temporaries = torch.cuda.max_memory_allocated() - before
    assert temporaries <= DEQUANT_CHUNK_BYTES + 4 * 2**20  # the chunk, its scales and tile indices
    assert torch.equal(out.cpu(), expected)
