"""float32 products with an lm_head on CPU through oneDNN rather than torch's default BLAS.

Both float32 heads (the engine's, grpo.inference.vllm_compat.cpu_float32_head, and the trainer's,
grpo.trainer.float32_logits) multiply a few hundred rows by a vocab x hidden weight. torch hands a
float32 CPU matmul to MKL's sgemm, which on the AMD EPYC machines grpo is measured on runs its AVX2
code even where the CPU has AVX512; oneDNN picks its kernels from the CPU's features. Measured on a
2-core AVX512-BF16 EPYC, [M, 576] x [576, 49152] (SmolLM2-135M's head), float32 throughout:

    M      MKL      oneDNN
    1      16.7 ms   7.8 ms
    64     55.3 ms  26.6 ms   (the engine's decode step of 64 sequences)
    526   276 ms   221 ms     (a trainer micro-batch's loss tokens)

With both libraries held to AVX2 (ONEDNN_MAX_CPU_ISA / MKL_ENABLE_INSTRUCTIONS) oneDNN still led
at M <= 64 (49 -> 30 ms at 64) and trailed by 10% at 526 (252 vs 278 ms). The results are float32
sums of the same products in another order: within 2e-6 of a float64 reference at these sizes,
as MKL's are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cpu_float32_linear(
    inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """inputs [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], all float32 on CPU, by oneDNN where
    torch has it (torch's F.linear otherwise). No autograd: callers run it where gradients are
    computed by hand or not at all."""
    import torch

    assert inputs.dtype == weight.dtype == torch.float32 and inputs.device.type == "cpu", (
        inputs.dtype,
        weight.dtype,
        inputs.device,
    )
    if not torch.backends.mkldnn.is_available():
        return torch.nn.functional.linear(inputs, weight, bias)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        inputs.contiguous(), weight.contiguous(), bias, "none", [], ""
    )
    return out
