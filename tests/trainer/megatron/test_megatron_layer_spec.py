"""The Megatron decoder's layer spec reads each call's attention mask (prefix trees included), with
and without Transformer Engine."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from grpo.config.trainer import TrainerConfig
from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.types import Rollout
from grpo.trainer.megatron import layer_spec
from grpo.trainer.megatron.layer_spec import gpt_layer_spec, use_transformer_engine
from grpo.transport.batches.batch import PackedRow


class FakeTEDotProductAttention:
    """Stands for megatron-core's TEDotProductAttention where transformer_engine is not installed."""


class FakeTELayerNormLinear:
    pass


class FakeTESpecProvider(LocalSpecProvider):
    """What megatron-core's TESpecProvider hands the TE spec, with stand-in classes."""

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return FakeTELayerNormLinear

    def core_attention(self) -> type:
        return FakeTEDotProductAttention


def test_the_local_spec_declares_an_arbitrary_mask_for_megatron_cores_attention() -> None:
    attention = gpt_layer_spec(use_te=False).submodules.self_attention
    assert attention.params["attn_mask_type"] is AttnMaskType.arbitrary
    assert attention.submodules.core_attention is DotProductAttention


def test_the_transformer_engine_spec_declares_an_arbitrary_mask_so_te_reads_the_tree_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # megatron-core's TE spec declares causal, and TE's attention then ignores the mask it is given.
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", FakeTESpecProvider, raising=False)
    stock = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec().submodules.self_attention
    assert stock.params["attn_mask_type"] is AttnMaskType.causal

    attention = gpt_layer_spec(use_te=True).submodules.self_attention
    assert attention.params["attn_mask_type"] is AttnMaskType.arbitrary
    assert attention.submodules.core_attention is FakeTEDotProductAttention
    assert attention.submodules.linear_qkv is FakeTELayerNormLinear


def test_transformer_engine_is_used_on_cuda_only_and_only_where_it_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed = {"transformer_engine": True}
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str) -> object | None:
        return object() if installed.get(name) else real_find_spec(name)

    monkeypatch.setattr(layer_spec.importlib.util, "find_spec", find_spec)
    assert use_transformer_engine(torch.device("cuda"))
    assert not use_transformer_engine(torch.device("cpu"))
    installed["transformer_engine"] = False
    assert not use_transformer_engine(torch.device("cuda"))


def _rollout(example: int, prompt: list[int], completion: list[int], seed: int) -> Rollout:
    rng = np.random.default_rng(seed)
    return Rollout(
        env_name="e",
        example_index=example,
        prompt_ids=prompt,
        completion_ids=completion,
        completion_mask=[True] * len(completion),
        completion_logprobs=[float(-rng.uniform(8.0, 14.0)) for _ in completion],  # distinct: name tokens
        temperature=1.0,
        start_version=0,
        end_version=0,
        advantage=float(rng.normal()),
    )


def _plain_and_shared_rows() -> tuple[list[PackedRow], list[PackedRow]]:
    """Two groups of three completions each, packed plainly and as prefix trees."""
    rng = np.random.default_rng(0)
    rollouts = []
    for group in range(2):
        prompt = rng.integers(0, 1000, 9 + 4 * group).tolist()
        for k in range(3):
            completion = rng.integers(0, 1000, 5 + 2 * k).tolist()
            rollouts.append(_rollout(group, prompt, completion, seed=10 * group + k))
    plain, _ = pack_rollouts(rollouts, 256, share_prefixes=False)
    shared, stats = pack_rollouts(rollouts, 256, share_prefixes=True)
    assert stats.num_tokens < stats.num_sample_tokens  # the prompts are shared
    return plain, shared


def _loss_token_logprobs(trainer: object, rows: list[PackedRow]) -> dict[float, float]:
    """Trainer logprob of every loss token, keyed by its (distinct) inference logprob."""
    out = {}
    for row, logprobs in zip(rows, trainer.score(rows), strict=True):  # type: ignore[attr-defined]
        for key, value in zip(row.inference_logprobs[row.loss_mask], logprobs[row.loss_mask], strict=True):
            out[float(key)] = float(value)
    return out


def _shared_and_plain_logprobs(cfg: TrainerConfig, tmp_path: Path) -> tuple[list[float], list[float]]:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    plain, shared = _plain_and_shared_rows()
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer = MegatronTrainer(cfg, tmp_path)
    plain_lp, shared_lp = _loss_token_logprobs(trainer, plain), _loss_token_logprobs(trainer, shared)
    trainer.close()
    assert plain_lp.keys() == shared_lp.keys() and len(plain_lp) == 2 * (5 + 7 + 9)
    return [shared_lp[k] for k in plain_lp], list(plain_lp.values())


@pytest.mark.usefixtures("float32_compute")
def test_shared_prefix_rows_give_the_logprobs_of_plain_rows_with_the_local_spec(
    megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    shared, plain = _shared_and_plain_logprobs(megatron_cfg(), tmp_path)
    np.testing.assert_allclose(shared, plain, atol=2e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.usefixtures("float32_compute")
def test_transformer_engine_on_cuda_gives_shared_prefix_rows_the_logprobs_of_the_local_spec(
    megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs transformer_engine (the TE layer spec)")
    cfg = megatron_cfg(device="cuda")
    te_shared, te_plain = _shared_and_plain_logprobs(cfg, tmp_path / "te")
    monkeypatch.setattr(layer_spec, "use_transformer_engine", lambda device: False)
    local_shared, local_plain = _shared_and_plain_logprobs(cfg, tmp_path / "local")
    # TF32 and TE's kernels reduce in other orders than the local spec's torch ops.
    np.testing.assert_allclose(te_shared, te_plain, atol=1e-3, rtol=0)
    np.testing.assert_allclose(te_shared, local_shared, atol=1e-3, rtol=0)
    np.testing.assert_allclose(local_shared, local_plain, atol=1e-3, rtol=0)
