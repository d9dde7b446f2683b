"""Model ids resolve offline: local path -> HF cache -> embedded store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.models import embedded
from grpo.models.resolve import resolve_model


def test_local_folder_resolves_to_itself(tiny_model_path: Path) -> None:
    resolved = resolve_model(str(tiny_model_path))
    assert resolved.source == "local" and resolved.path == tiny_model_path.resolve()


def test_missing_local_path_says_so() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("./no/such/folder")


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        resolve_model(str(tmp_path))


def test_embedded_model_id_resolves_offline_and_says_it_is_dequantized(embedded_model_path: Path) -> None:
    resolved = resolve_model(embedded.EMBEDDED_MODEL_ID, allow_download=False)
    assert resolved.source == "embedded"
    assert resolved.path == embedded_model_path
    assert "Q4_1-dequantized" in resolved.describe()
    config = json.loads((resolved.path / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30


def test_hf_cache_is_used_before_the_embedded_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_path: Path
) -> None:
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny_model_path / "config.json").read_text())
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    resolved = resolve_model("org/cached", allow_download=False)
    assert resolved.source == "hf-cache" and resolved.path == snapshot


def test_unknown_id_offline_explains_where_it_looked() -> None:
    with pytest.raises(
        ValueError, match="not found as a local path, in the HF cache or in the embedded store"
    ):
        resolve_model("nobody/nothing", allow_download=False)


def test_embedded_model_generates_sensible_text(embedded_model_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_path, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])
