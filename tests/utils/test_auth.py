"""Shared secrets: what grpo accepts as a secret or key from the environment."""

from __future__ import annotations

import logging

import pytest

from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.loading import validate
from grpo.utils.auth import open_without_secret, secret_from_env
from grpo.utils.errors import UserError

MIN_SECRET_CHARS = 16
STRONG = "k" * MIN_SECRET_CHARS


def test_a_secret_of_the_minimum_length_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_TEST_SECRET", STRONG)
    assert secret_from_env("GRPO_TEST_SECRET") == STRONG.encode()


def test_an_unset_or_empty_secret_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_TEST_SECRET", raising=False)
    assert secret_from_env("GRPO_TEST_SECRET") is None
    monkeypatch.setenv("GRPO_TEST_SECRET", "")
    assert secret_from_env("GRPO_TEST_SECRET") is None


@pytest.mark.parametrize("value", [" ", "\t \n", " " * 40])
def test_a_whitespace_only_secret_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("GRPO_TEST_SECRET", value)
    with pytest.raises(UserError, match=r"\$GRPO_TEST_SECRET is only whitespace.*token_urlsafe"):
        secret_from_env("GRPO_TEST_SECRET")


@pytest.mark.parametrize("value", ["x", "secret", "k" * (MIN_SECRET_CHARS - 1), " padded-short  "])
def test_a_secret_shorter_than_the_minimum_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("GRPO_TEST_SECRET", value)
    with pytest.raises(UserError, match=rf"\$GRPO_TEST_SECRET .* at least {MIN_SECRET_CHARS}"):
        secret_from_env("GRPO_TEST_SECRET")


def test_a_weak_secret_is_refused_on_loopback_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set but weak is a mistake wherever the endpoint binds: it is refused, not ignored.
    monkeypatch.setenv("GRPO_TEST_SECRET", "short")
    with pytest.raises(UserError):
        open_without_secret("127.0.0.1", "GRPO_TEST_SECRET")


def test_a_weak_api_key_is_refused_when_the_inference_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", " ")
    with pytest.raises(ConfigError, match="MY_KEY is only whitespace"):
        validate(InferenceConfig, {"model": "m", "host": "10.0.0.5", "api_key_var": "MY_KEY"}, "infer.yaml")


def test_a_token_bound_for_another_machine_in_clear_text_is_warned_about_once_per_server(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo.utils import auth
    from grpo.utils.logging import get_logger

    monkeypatch.setattr(auth, "_warned_plaintext", set())
    logger = get_logger("security")
    logger.addHandler(caplog.handler)  # grpo loggers do not propagate to the root logger caplog watches
    try:
        for url in (
            "https://judge.example/v1",
            "wss://env.example:443/ws",
            "http://127.0.0.1:8000/v1",
            "http://localhost:9000",
            "http://10.0.0.5:8000/v1",
            "http://10.0.0.5:8000/v1/other",
            "ws://env.example:8001",
        ):
            auth.warn_if_plaintext_token(url, "judge")
    finally:
        logger.removeHandler(caplog.handler)
    # one record may reach caplog twice (its handler here and, where another test left the grpo
    # logger propagating, on the root logger): count records, not deliveries
    records = {id(r): r for r in caplog.records if r.levelno == logging.WARNING}
    warnings = [r.getMessage() for r in records.values()]
    assert len(warnings) == 2, warnings
    assert "http://10.0.0.5:8000 in clear text" in warnings[0] and "ws://env.example:8001" in warnings[1]
    assert all("TLS" in w and "\n" not in w for w in warnings)
