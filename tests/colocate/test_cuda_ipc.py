"""CUDA IPC borrowing between two processes (bf16, NF4, FP8): run where a GPU is lent.

The exporter holds the weights (as vLLM's worker would) and publishes records with
grpo.inference.weight_handles.export_record; the borrower rebuilds them and must see the same
memory: equal values, and a later write by the exporter visible without any copy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

EXPORTER = textwrap.dedent(
    """
    import json, sys, torch
    from grpo.inference.weight_handles import export_record
    torch.manual_seed(0)
    tensors = {
        "bf16": torch.randn(256, 128, dtype=torch.bfloat16, device="cuda"),
        "nf4_packed": torch.randint(0, 256, (256 * 128 // 2,), dtype=torch.uint8, device="cuda"),
        "nf4_absmax": torch.rand(256 * 128 // 64, device="cuda") + 0.5,
        "fp8": torch.randn(256, 256, device="cuda").to(torch.float8_e4m3fn),
        "fp8_scale": torch.rand(2, 2, device="cuda") + 0.5,
    }
    print(json.dumps([export_record(n, t) for n, t in tensors.items()]), flush=True)
    sys.stdin.readline()  # borrower has read the values
    tensors["bf16"].fill_(3.0)
    torch.cuda.synchronize()
    print("written", flush=True)
    sys.stdin.readline()  # keep the memory alive until the borrower is done
    """
)


def test_borrowed_cuda_weights_are_the_exporters_memory() -> None:
    import torch

    from grpo.inference.weight_handles import rebuild_tensor
    from grpo.trainer.hf.dequant import dequantize_fp8_block, dequantize_nf4
    from grpo.trainer.quantized_weights import FP8BlockWeight, NF4Weight

    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        records = json.loads(exporter.stdout.readline())
        borrowed = {r["name"]: rebuild_tensor(r) for r in records}
        torch.manual_seed(0)
        expected_bf16 = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda")
        assert torch.equal(borrowed["bf16"], expected_bf16)

        code = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                             0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0], device="cuda")  # fmt: skip
        nf4 = NF4Weight(borrowed["nf4_packed"], borrowed["nf4_absmax"], code, 64, (256, 128))
        assert torch.isfinite(dequantize_nf4(nf4)).all()
        fp8 = dequantize_fp8_block(FP8BlockWeight(borrowed["fp8"], borrowed["fp8_scale"], 128))
        assert fp8.shape == (256, 256) and torch.isfinite(fp8).all()

        exporter.stdin.write("go\n")
        exporter.stdin.flush()
        assert exporter.stdout.readline().strip() == "written"
        torch.cuda.synchronize()
        assert bool((borrowed["bf16"] == 3.0).all()), "the borrower holds a copy, not the exporter's memory"
        exporter.stdin.write("done\n")
        exporter.stdin.flush()
    finally:
        exporter.wait(timeout=60)
