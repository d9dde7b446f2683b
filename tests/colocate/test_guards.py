"""Settings that break weight borrowing are refused before anything starts."""

from __future__ import annotations

import pytest

from grpo.colocate.guards import check_borrowing_safe


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
