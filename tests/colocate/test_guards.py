"""Settings that break weight borrowing are refused before anything starts."""

from __future__ import annotations

import pytest

from grpo.colocate.guards import check_borrowing_safe
from grpo.utils.errors import UserError


def test_expandable_segments_on_the_exporter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments"):
        check_borrowing_safe([])


def test_vllm_sleep_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(ValueError, match="sleep mode"):
        check_borrowing_safe(["--model", "m", "--enable-sleep-mode"])


def test_plain_settings_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    check_borrowing_safe(["--model", "m"])


def test_moe_families_whose_experts_are_not_mapped_are_refused_naming_the_multi_process_mode(
    tmp_path, tiny_model_path
):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    from grpo.colocate.guards import check_borrowable_model

    Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2).save_pretrained(tmp_path / "q2")
    with pytest.raises(UserError, match=r"qwen2_moe is a mixture-of-experts model.*as separate processes"):
        check_borrowable_model(tmp_path / "q2")
    Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2).save_pretrained(tmp_path / "q3")
    check_borrowable_model(tmp_path / "q3")  # experts borrowed (grpo.colocate.expert_views)
    MixtralConfig(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2).save_pretrained(
        tmp_path / "mx"
    )
    check_borrowable_model(tmp_path / "mx")
    check_borrowable_model(tiny_model_path)  # dense: borrowed as before
