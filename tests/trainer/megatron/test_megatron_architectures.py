"""The other architectures and variants backend megatron accepts compute what HF computes: Qwen2
(q/k/v biases, tied or not), Mistral (a sliding window no sample reaches), Llama with as many KV
heads as heads, an explicit head_dim and another (fractional) rope_theta, Llama 3.1's and linear
RoPE scaling."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from trainer_batches import make_row, reference_logprobs

from grpo.config.trainer import TrainerConfig
from grpo.trainer.megatron.convert import DecoderShape, hf_to_megatron, megatron_to_hf
from grpo.trainer.megatron.model import read_hf_weights

WINDOW = 16
"""Mistral's sliding window: every sample below is at most this long (and sequence_len is it)."""

_SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2 untied": ("Qwen2", {"tie_word_embeddings": False}),
    "qwen2 tied": ("Qwen2", {"tie_word_embeddings": True}),
    "mistral window": ("Mistral", {"sliding_window": WINDOW}),
    "llama mha head_dim theta": (
        "Llama",
        {"num_key_value_heads": 4, "head_dim": 48, "rope_theta": 500000.5, "tie_word_embeddings": False},
    ),
    # Llama 3.1's frequencies (rescaled below original_max_position_embeddings' wavelengths).
    "llama3 rope": (
        "Llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "linear rope": (
        "Llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ),
}


def _build(path: Path, family: str, fields: dict[str, Any]) -> Path:
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**_SHAPE, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: make both count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, fields = VARIANTS[request.param]
    return _build(tmp_path_factory.mktemp(request.param.replace(" ", "_")), family, fields)


def test_hf_to_megatron_and_back_is_exact(variant_path: Path) -> None:
    from transformers import AutoConfig

    hf = read_hf_weights(variant_path)
    shape = DecoderShape.from_hf_config(AutoConfig.from_pretrained(variant_path))
    back = megatron_to_hf(hf_to_megatron(hf, shape), shape)
    expected = {k: v for k, v in hf.items() if not (shape.tied_embeddings and k == "lm_head.weight")}
    assert set(back) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.usefixtures("float32_compute")
def test_megatron_logprobs_equal_the_hf_models(
    variant_path: Path, megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    rows = [  # samples of 16 tokens: as long as Mistral's window, never past it
        make_row([(6, 10), (4, 12)], [1.0, -1.0], seed=1, temperature=0.7),
        make_row([(9, 7)], [0.5], seed=2, temperature=1.3),
    ]
    trainer = MegatronTrainer(megatron_cfg(model=str(variant_path), sequence_len=WINDOW), tmp_path)
    got = trainer.score(rows)
    trainer.close()
    for lp, ref in zip(got, reference_logprobs(variant_path, rows), strict=True):
        np.testing.assert_allclose(lp, ref, atol=2e-6)
