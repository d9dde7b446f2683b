"""backend megatron refuses, in one line naming the model's field, every model it would compute
differently from HF, and a run it cannot start."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from grpo.config.trainer import TrainerConfig
from grpo.trainer.megatron.convert import DecoderShape, hf_to_megatron
from grpo.trainer.megatron.preflight import check_megatron_start, check_supported_model
from grpo.utils.errors import UserError

_SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _config(cls: type, architecture: str, **fields: Any) -> Any:
    return cls(**{**_SHAPE, **fields}, architectures=[architecture])


def _llama(**fields: Any) -> Any:
    return _config(LlamaConfig, "LlamaForCausalLM", **fields)


def _mistral(**fields: Any) -> Any:
    return _config(MistralConfig, "MistralForCausalLM", **fields)


def _qwen2(**fields: Any) -> Any:
    return _config(Qwen2Config, "Qwen2ForCausalLM", **fields)


REFUSED: list[tuple[str, Callable[[], Any], str]] = [
    ("Mistral window shorter than sequence_len", lambda: _mistral(sliding_window=512), "sliding_window"),
    (
        "Qwen2 with use_sliding_window",
        lambda: _qwen2(use_sliding_window=True, sliding_window=512, max_window_layers=1),
        "sliding_window",
    ),
    (
        "YaRN RoPE (scales attention too)",
        lambda: _llama(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        "rope_type 'yarn'",
    ),
    ("GELU MLP", lambda: _llama(hidden_act="gelu"), "hidden_act"),
    ("Llama attention_bias (o_proj too)", lambda: _llama(attention_bias=True), "attention_bias"),
    ("Llama mlp_bias", lambda: _llama(mlp_bias=True), "mlp_bias"),
    ("GPT-2", lambda: GPT2Config(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
]


@pytest.mark.parametrize(("case", "config", "field"), REFUSED, ids=[c[0] for c in REFUSED])
def test_a_model_megatron_would_compute_differently_is_refused_naming_its_field(
    case: str, config: Callable[[], Any], field: str
) -> None:
    with pytest.raises(UserError) as err:
        check_supported_model(config(), sequence_len=1024)
    message = str(err.value)
    assert field in message and "backend: hf" in message and "\n" not in message


@pytest.mark.parametrize(
    "config",
    [
        # Qwen2.5's configs name a window with use_sliding_window false: every layer attends fully.
        lambda: _qwen2(use_sliding_window=False, sliding_window=32768),
        lambda: _mistral(sliding_window=1024),  # never shorter than a sample: never applies
        lambda: _mistral(sliding_window=None),
        lambda: _llama(rope_theta=500000.0, num_key_value_heads=4, head_dim=48, tie_word_embeddings=False),
    ],
)
def test_a_model_megatron_computes_as_hf_passes(config: Callable[[], Any]) -> None:
    check_supported_model(config(), sequence_len=1024)


def test_a_checkpoint_tensor_without_a_megatron_place_is_refused_not_dropped() -> None:
    import torch
    from transformers import LlamaForCausalLM

    config = _llama(attention_bias=True)
    torch.manual_seed(0)
    weights = LlamaForCausalLM(config).state_dict()
    with pytest.raises(UserError) as err:
        hf_to_megatron(weights, DecoderShape.from_hf_config(config))
    assert "model.layers.0.self_attn.o_proj.bias" in str(err.value) and "backend: hf" in str(err.value)


@pytest.fixture
def llama_folder(tmp_path: Path) -> Path:
    _llama().save_pretrained(tmp_path)
    return tmp_path


def _cfg(model: Path, **fields: Any) -> TrainerConfig:
    return TrainerConfig(model=str(model), backend="megatron", lora=False, **fields)


def test_without_megatron_core_the_fix_is_the_extra(
    llama_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name.startswith("megatron") else real_find_spec(name, *args),
    )
    with pytest.raises(UserError, match=r"pip install 'grpo-rl\[megatron\]'"):
        check_megatron_start(_cfg(llama_folder), llama_folder, world_size=1)


def test_several_gpus_in_one_process_are_refused_with_the_torchrun_command(llama_folder: Path) -> None:
    with pytest.raises(UserError, match="torchrun --nproc_per_node 2"):
        check_megatron_start(_cfg(llama_folder, gpus=2), llama_folder, world_size=1)


def test_a_launch_with_other_than_gpus_processes_is_refused(llama_folder: Path) -> None:
    with pytest.raises(UserError, match="set gpus: 4"):
        check_megatron_start(_cfg(llama_folder, gpus=2), llama_folder, world_size=4)
    check_megatron_start(_cfg(llama_folder, gpus=2), llama_folder, world_size=2)


def test_qwen3_moe_with_experts_in_every_layer_is_accepted():
    from transformers import Qwen3MoeConfig

    moe = _config(Qwen3MoeConfig, "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2)
    check_supported_model(moe, sequence_len=1024)


def test_other_mixture_of_experts_families_are_refused_naming_backend_hf():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    mixtral = _config(MixtralConfig, "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(
        UserError, match=r"mixture-of-experts layers; backend megatron converts Qwen3MoeForCausalLM only"
    ):
        check_supported_model(mixtral, sequence_len=1024)
    shared = _config(Qwen2MoeConfig, "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(UserError, match="use backend: hf"):
        check_supported_model(shared, sequence_len=1024)
    mixed = _config(Qwen3MoeConfig, "Qwen3MoeForCausalLM", num_experts=4, mlp_only_layers=[0])
    with pytest.raises(UserError, match="mixes dense and mixture-of-experts layers"):
        check_supported_model(mixed, sequence_len=1024)
