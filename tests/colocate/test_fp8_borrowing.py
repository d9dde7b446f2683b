"""A vLLM engine serving FP8 (fp8_per_block) lends its FP8 codes + scales to the trainer, no copy."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo.config.machine.fp8_support import fp8_problems

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    # vLLM's block-FP8 CPU kernels need AMX tiles; on other CPUs grpo refuses the setting at load.
    pytest.mark.skipif(
        bool(fp8_problems("fp8_per_block")), reason="no block-FP8 kernel here (needs AMX or CUDA)"
    ),
]


@pytest.fixture(scope="module")
def fp8_engine(tiny_model_path: Path) -> Iterator[Any]:
    from vllm import LLM

    from grpo.inference.server_args import WORKER_EXTENSION_CLS

    env = {
        "GRPO_KEEP_DENSE_WEIGHTS": "1",  # the engine subprocess keeps FP8 weights row-major (borrowable)
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    llm = LLM(
        model=str(tiny_model_path),
        quantization="fp8_per_block",
        worker_extension_cls=WORKER_EXTENSION_CLS,
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
    )
    try:
        yield llm
    finally:
        # Borrowed views caught in reference cycles (PEFT modules) go before the engine they map.
        gc.collect()
        llm.llm_engine.engine_core.shutdown()
        del llm
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_trainer_trains_lora_on_the_engines_fp8_weights(fp8_engine: Any, tiny_model_path: Path) -> None:
    from vllm import SamplingParams

    from grpo.colocate.borrow import borrow_from_records
    from grpo.config.trainer import TrainerConfig
    from grpo.inference.weight_handles import release_shared_names
    from grpo.trainer.hf.model import build_policy
    from grpo.trainer.hf.quantized_base import decoder_linear_names, quantized_linear_class
    from grpo.trainer.weights import BorrowedWeights, DiskWeights

    (records,) = fp8_engine.collective_rpc("export_weight_handles")
    borrowed = borrow_from_records(records, tiny_model_path)
    release_shared_names(records)
    assert len(borrowed.quantized) == 2 * 7 and not borrowed.tensors and borrowed.checked
    assert all(q.weight.dtype == torch.float8_e4m3fn for q in borrowed.quantized.values())

    cfg = TrainerConfig(
        model=str(tiny_model_path), optimizer="adamw", gradient_checkpointing=False,
        lora_target_modules=["all-linear"], lora_rank=4, lora_alpha=8,
    )  # fmt: skip
    policy = build_policy(cfg, BorrowedWeights(tiny_model_path, {}, borrowed.quantized))
    for name in decoder_linear_names(policy.causal_lm):
        base = policy.causal_lm.get_submodule(name)
        assert isinstance(base, quantized_linear_class())
        engine_view = borrowed.quantized[name.removesuffix(".base_layer")]
        assert base.weight.data_ptr() == engine_view.weight.data_ptr(), f"{name} was copied"
        assert base.weight_scale.data_ptr() == engine_view.scale.data_ptr()

    dense = build_policy(cfg, DiskWeights(tiny_model_path))
    input_ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = dense.model(input_ids=input_ids).logits.float()
        got = policy.model(input_ids=input_ids).logits.float()
    assert (
        got - reference
    ).norm() / reference.norm() < 0.08  # E4M3 rounding: see tests/trainer/hf/test_quant_fp8.py

    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = policy.model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses

    # The engine still serves from the (row-major) FP8 weights it lent.
    (out,) = fp8_engine.generate(["hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    del policy, borrowed
