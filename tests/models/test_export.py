"""Exported policies: the merged model computes what base + adapter computes, in the base's dtype,
with the tokenizer and generation config; the adapter alone loads with PEFT; outputs are atomic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from trained_runs import train_and_publish

from grpo.models.export import (
    check_mergeable_base,
    policy_kind,
    prepare_output,
    push_to_hub,
    stored_dtype,
    write_adapter,
    write_merged,
)
from grpo.transport.weights.filesystem import broadcast_dir
from grpo.utils.errors import UserError

TOKENS = torch.tensor([[1, 504, 3458, 282, 4195, 314, 260, 3436, 28, 1159]])


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("lora_run")
    train_and_publish(run_dir, tiny_model_path, lora=True)
    return broadcast_dir(run_dir, 1)


@pytest.fixture(scope="module")
def full_policy(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("full_run")
    train_and_publish(run_dir, tiny_model_path, lora=False)
    return broadcast_dir(run_dir, 1)


def _logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits[0]


def _tensor_dtypes(folder: Path) -> set[torch.dtype]:
    from safetensors.torch import load_file

    return {t.dtype for file in folder.glob("*.safetensors") for t in load_file(str(file)).values()}


def test_merged_lora_export_computes_the_logits_of_base_plus_adapter(
    lora_policy: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    write_merged(lora_policy, "adapter", tiny_model_path, tmp_path / "out", "float32")

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(TOKENS).logits[0]
        adapted = PeftModel.from_pretrained(base, lora_policy)
        expected = adapted(TOKENS).logits[0]
    merged = _logits(tmp_path / "out")
    assert (expected - base_logits).abs().max() > 1e-3  # the trained adapter is not the identity
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=0)


def test_merged_export_is_stored_in_the_base_dtype_with_tokenizer_and_generation_config(
    lora_policy: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    assert stored_dtype(tiny_model_path) == "bfloat16"
    out = tmp_path / "out"
    write_merged(lora_policy, "adapter", tiny_model_path, out, stored_dtype(tiny_model_path))

    assert _tensor_dtypes(out) == {torch.bfloat16}
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert config["use_cache"] is True  # the trainer turns it off; generation wants it on
    assert (
        AutoTokenizer.from_pretrained(out)("hello").input_ids
        == AutoTokenizer.from_pretrained(tiny_model_path)("hello").input_ids
    )
    GenerationConfig.from_pretrained(out)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left beside it


def test_full_weight_export_computes_the_published_weights_in_the_base_dtype(
    full_policy: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    assert policy_kind(full_policy) == "full"
    # The trainer keeps full weights in float32; the export goes back to the base's bf16.
    assert _tensor_dtypes(full_policy) == {torch.float32}
    write_merged(full_policy, "full", tiny_model_path, tmp_path / "bf16", "bfloat16")
    write_merged(full_policy, "full", tiny_model_path, tmp_path / "fp32", "float32")

    assert _tensor_dtypes(tmp_path / "bf16") == {torch.bfloat16}
    torch.testing.assert_close(_logits(tmp_path / "fp32"), _logits(full_policy), atol=1e-6, rtol=0)
    assert (tmp_path / "bf16" / "tokenizer.json").exists()


def test_adapter_only_export_loads_with_peft_and_holds_the_trained_weights(
    lora_policy: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    write_adapter(lora_policy, out)

    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out)
    trained = load_file(str(lora_policy / "adapter_model.safetensors"))
    lora_b = {n: p for n, p in loaded.named_parameters() if "lora_B" in n}
    assert lora_b and any(p.abs().max() > 0 for p in lora_b.values())
    assert all(
        torch.equal(t, load_file(str(out / "adapter_model.safetensors"))[n]) for n, t in trained.items()
    )


def test_a_non_empty_output_is_refused_unless_forced_and_then_replaced(
    lora_policy: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run_dir = lora_policy.parent.parent
    prepare_output(out, force=False, source=run_dir)  # missing: fine
    out.mkdir()
    prepare_output(out, force=False, source=run_dir)  # empty: fine
    (out / "old.txt").write_text("x")
    with pytest.raises(UserError, match="--force"):
        prepare_output(out, force=False, source=run_dir)
    prepare_output(out, force=True, source=run_dir)
    write_adapter(lora_policy, out)
    assert not (out / "old.txt").exists() and (out / "adapter_config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing staged or moved aside is left


@pytest.mark.parametrize("out", ["run", ".", "run/../run"])
def test_the_run_directory_or_a_folder_holding_it_is_never_the_output_even_forced(
    out: str, tmp_path: Path
) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match="holds the run directory"):
        prepare_output(tmp_path / out, force=True, source=tmp_path / "run")


def test_a_failed_export_leaves_no_output_and_no_staging_folder(tmp_path: Path) -> None:
    empty_policy = tmp_path / "step_1"
    empty_policy.mkdir()
    with pytest.raises(FileNotFoundError):
        write_adapter(empty_policy, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_a_folder_without_adapter_or_weights_is_no_policy(tmp_path: Path) -> None:
    (tmp_path / "collective.json").write_text("{}")
    with pytest.raises(UserError, match="--step"):
        policy_kind(tmp_path)


def test_stored_dtype_falls_back_to_the_safetensors_header(tiny_model_path: Path, tmp_path: Path) -> None:
    import shutil

    config = json.loads((tiny_model_path / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_model_path / "model.safetensors", tmp_path / "model.safetensors")
    assert stored_dtype(tmp_path) == "bfloat16"


def test_a_quantized_base_is_refused_for_merging_with_the_adapter_only_alternative(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(UserError, match="--adapter-only"):
        check_mergeable_base(tmp_path)


def test_push_to_hub_is_skipped_offline_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    message = push_to_hub(tmp_path, "me/model")
    assert message.startswith("skipped --push-to-hub me/model") and "\n" not in message


class _RecordingHub:
    """Stands in for huggingface_hub.HfApi: records what would be created and uploaded."""

    created: ClassVar[list[dict[str, object]]] = []

    def create_repo(self, repo_id: str, **kwargs: object) -> None:
        self.created.append({"repo_id": repo_id, **kwargs})

    def upload_folder(self, folder_path: str, repo_id: str, repo_type: str) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(repo_url=f"https://hub.example/{repo_id}")


@pytest.mark.parametrize(("public", "private"), [(False, True), (True, False)])
def test_push_to_hub_creates_a_private_repo_unless_asked_for_a_public_one(
    public: bool, private: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", _RecordingHub)
    monkeypatch.setattr(_RecordingHub, "created", [])
    message = push_to_hub(tmp_path, "me/model", public=public)
    assert _RecordingHub.created == [
        {"repo_id": "me/model", "repo_type": "model", "exist_ok": True, "private": private}
    ]
    assert message.startswith("pushed ") and ("public" in message) == public


def test_an_exported_adapter_names_its_base_by_hub_id_or_folder_name_never_a_local_path(
    lora_policy: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    recorded = json.loads((lora_policy / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(recorded).is_absolute()  # what the trainer publishes: the folder it loaded

    write_adapter(lora_policy, tmp_path / "by_id", base_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    write_adapter(lora_policy, tmp_path / "by_path", base_name=str(tiny_model_path))
    write_adapter(lora_policy, tmp_path / "as_recorded")

    def base_of(out: str) -> str:
        return json.loads((tmp_path / out / "adapter_config.json").read_text())["base_model_name_or_path"]

    assert base_of("by_id") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_of("by_path") == tiny_model_path.name
    assert base_of("as_recorded") == Path(recorded).name
    for out in ("by_id", "by_path", "as_recorded"):
        assert str(tiny_model_path.parent) not in (tmp_path / out / "adapter_config.json").read_text()


def test_megatron_weights_in_several_files_export_as_one_model(tiny_model_path: Path, tmp_path: Path) -> None:
    from grpo.trainer.megatron.export import write_hf_folder
    from grpo.trainer.megatron.model import read_hf_weights

    # The Megatron backend's published folder: HF-named safetensors in size-bounded files with an
    # index, the base's config.json, no generation config or tokenizer.
    policy = tmp_path / "step_1"
    policy.mkdir()
    write_hf_folder(read_hf_weights(tiny_model_path), tiny_model_path, policy, max_bytes=2 * 1024**2)
    assert len(list(policy.glob("model-*-of-*.safetensors"))) >= 2
    assert policy_kind(policy) == "full"

    write_merged(policy, "full", tiny_model_path, tmp_path / "out", "float32")
    torch.testing.assert_close(_logits(tmp_path / "out"), _logits(tiny_model_path), atol=1e-6, rtol=0)
    assert (tmp_path / "out" / "tokenizer.json").exists()
    assert (tmp_path / "out" / "generation_config.json").exists()
