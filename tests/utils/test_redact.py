"""Credentials never reach W&B's run config: URL passwords, secret query values and secret fields
are replaced; names of environment variables, sizes and ordinary settings are kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from grpo.envs.judge import Endpoint
from grpo.utils.redact import REDACTED, redact, redact_url
from grpo.utils.wandb_run import _runs, _runs_lock, open_run


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://alice:s3cret@judge.example/v1", "https://alice:***@judge.example/v1"),
        ("http://tok3n@env.example:8000/v1", "http://***@env.example:8000/v1"),
        ("wss://env.example/ws?token=abc&page=2", "wss://env.example/ws?token=***&page=2"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
        ("not a url: user:pass@host", "not a url: user:pass@host"),
    ],
)
def test_urls_lose_their_passwords_and_secret_query_values(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_secret_fields_are_replaced_and_everything_else_is_kept() -> None:
    config = {
        "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "client": {"api_key_var": "VLLM_API_KEY", "base_url": ["https://u:p@h.example/v1"]},
        "env": [{"id": "my-env", "args": {"api_key": "sk-live-123", "hf_token": "hf_abc", "num_rows": 5}}],
        "judge": {"api_key_env": "JUDGE_KEY", "password": None},
        "sampling": {"max_tokens": 128},
        "loss": {"token_mask_low": 0.1},
    }
    out = redact(config)
    assert out["client"] == {"api_key_var": "VLLM_API_KEY", "base_url": ["https://u:***@h.example/v1"]}
    assert out["env"][0]["args"] == {"api_key": REDACTED, "hf_token": REDACTED, "num_rows": 5}
    assert out["judge"] == {"api_key_env": "JUDGE_KEY", "password": None}
    assert out["sampling"] == {"max_tokens": 128} and out["loss"] == {"token_mask_low": 0.1}
    assert out["model"] == config["model"]
    assert config["env"][0]["args"]["api_key"] == "sk-live-123"  # the caller's copy is untouched


def test_w_and_b_receives_the_run_config_redacted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import wandb

    received: list[dict[str, Any]] = []

    class FakeRun:
        step = 0

        def define_metric(self, *args: Any, **kwargs: Any) -> None:
            pass

    def fake_init(**kwargs: Any) -> FakeRun:
        received.append(kwargs["config"])
        return FakeRun()

    monkeypatch.setattr(wandb, "init", fake_init)
    config = {"env": [{"args": {"url": "https://me:hunter2@env.example", "api_key": "sk-1"}}]}
    run = open_run(tmp_path, project="p", name=None, offline=True, config=config)
    try:
        assert received == [{"env": [{"args": {"url": "https://me:***@env.example", "api_key": REDACTED}}]}]
    finally:
        with _runs_lock:
            _runs.pop(run.run_dir, None)


def test_a_judge_endpoint_does_not_show_its_key() -> None:
    endpoint = Endpoint("https://judge.example/v1", "judge-model", api_key="sk-very-secret")
    assert "sk-very-secret" not in repr(endpoint) and "sk-very-secret" not in str(endpoint)
