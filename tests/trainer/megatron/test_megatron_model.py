"""The Megatron backend's model: HF <-> Megatron conversion and logprobs equal to the HF model's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from trainer_batches import make_row, reference_logprobs

from grpo.config.trainer import TrainerConfig
from grpo.trainer.megatron.convert import (
    DecoderShape,
    hf_to_megatron,
    megatron_to_hf,
    tp_merge,
    tp_slice,
)
from grpo.trainer.megatron.model import read_hf_weights


def _shape(model_path: Path) -> DecoderShape:
    from transformers import AutoConfig

    return DecoderShape.from_hf_config(AutoConfig.from_pretrained(model_path))


@pytest.mark.parametrize("fixture", ["tiny_model_path", "tiny_llama_tp2_path"])
def test_hf_to_megatron_and_back_reproduces_the_checkpoint_exactly(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)
    hf = read_hf_weights(path)
    shape = _shape(path)
    back = megatron_to_hf(hf_to_megatron(hf, shape), shape)
    expected = {k: v for k, v in hf.items() if not (shape.tied_embeddings and k == "lm_head.weight")}
    assert set(back) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_groups_each_kv_heads_queries_with_it(tiny_llama_tp2_path: Path) -> None:
    hf = read_hf_weights(tiny_llama_tp2_path)
    shape = _shape(tiny_llama_tp2_path)  # 4 heads, 2 KV heads of 64: per group [q0; q1; k; v]
    qkv = hf_to_megatron(hf, shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = shape.head_dim
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    group1 = qkv[4 * d : 8 * d]
    assert torch.equal(group1[: 2 * d], q[2 * d : 4 * d])
    assert torch.equal(group1[2 * d : 3 * d], k[d : 2 * d])


def test_tensor_parallel_slices_merge_back_exactly(tiny_llama_tp2_path: Path) -> None:
    shape = _shape(tiny_llama_tp2_path)
    whole = hf_to_megatron(read_hf_weights(tiny_llama_tp2_path), shape)
    for name, tensor in whole.items():
        parts = [tp_slice(name, tensor, rank, 2) for rank in range(2)]
        assert torch.equal(tp_merge(name, parts), tensor), name
    fc1 = whole["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    rank1 = tp_slice("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    assert torch.equal(rank1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))  # [its gate; its up]


def _rows() -> list:
    return [
        make_row([(6, 10), (4, 12)], [1.0, -1.0], seed=1, temperature=0.7),
        make_row([(9, 7)], [0.5], seed=2, temperature=1.3),
    ]


@pytest.mark.usefixtures("float32_compute")
@pytest.mark.parametrize("fixture", ["tiny_model_path", "tiny_llama_tp2_path"])
def test_megatron_logprobs_equal_the_hf_models(
    fixture: str, request: pytest.FixtureRequest, megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    path = request.getfixturevalue(fixture)
    rows = _rows()
    trainer = MegatronTrainer(megatron_cfg(model=str(path)), tmp_path)
    got = trainer.score(rows)
    trainer.close()
    for lp, ref in zip(got, reference_logprobs(path, rows), strict=True):
        np.testing.assert_allclose(lp, ref, atol=2e-5)


@pytest.mark.slow
@pytest.mark.usefixtures("float32_compute")
def test_megatron_logprobs_equal_the_hf_models_on_smollm2(
    embedded_model_path: Path, megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    rows = _rows()
    trainer = MegatronTrainer(megatron_cfg(model=str(embedded_model_path)), tmp_path)
    got = trainer.score(rows)
    trainer.close()
    for lp, ref in zip(got, reference_logprobs(embedded_model_path, rows), strict=True):
        np.testing.assert_allclose(lp, ref, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.usefixtures("float32_compute")
def test_megatron_logprobs_on_cuda_equal_the_hf_models(
    tiny_llama_tp2_path: Path, megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    rows = _rows()
    trainer = MegatronTrainer(megatron_cfg(model=str(tiny_llama_tp2_path), device="cuda"), tmp_path)
    got = trainer.score(rows)
    trainer.close()
    for lp, ref in zip(got, reference_logprobs(tiny_llama_tp2_path, rows), strict=True):
        np.testing.assert_allclose(lp, ref, atol=1e-4)  # TF32/cuBLAS reductions differ from the CPU's


def test_bf16_megatron_logprobs_come_from_unrounded_float32_logits(
    megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM computes float32 logits (head_dtype float32); a bf16 product would round each logit by up
    to 1/256 of its size, a mismatch of its own."""
    from grpo.trainer.megatron.logprobs import token_logprobs
    from grpo.trainer.megatron.trainer import MegatronTrainer

    monkeypatch.setattr("grpo.trainer.device.choose_dtype", lambda device: torch.bfloat16)
    trainer = MegatronTrainer(megatron_cfg(), tmp_path)
    model = trainer.model
    weight = model.output_weight()
    weight = model.module.output_layer.weight if weight is None else weight
    assert weight.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(40, weight.shape[1], generator=gen) * 8).to(torch.bfloat16)  # logits of 10-30
    targets = torch.randint(0, weight.shape[0], (40,), generator=gen)
    with torch.no_grad():
        lp, _, _ = token_logprobs(model, hidden, targets, torch.ones(40), chunk_size=16)
    trainer.close()
    exact = torch.log_softmax(hidden.double() @ weight.detach().double().T, -1)
    exact = exact.gather(-1, targets[:, None]).squeeze(-1)
    rounded = (
        torch.log_softmax((hidden @ weight.detach().T).float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    )
    assert (lp.double() - exact).abs().max() < 1e-4
    assert (rounded.double() - exact).abs().max() > 1e-3  # the test can tell the two apart
