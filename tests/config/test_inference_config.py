"""infer.yaml: a server other machines can reach needs an API key (it guards the weight routes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from one_line_refusal import assert_refused_in_one_line

from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.loading import validate

BIN = Path(sys.executable).parent


def test_a_public_bind_without_an_api_key_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        validate(InferenceConfig, {"model": "m", "host": "0.0.0.0"}, "infer.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "export VLLM_API_KEY=" in lines[0] and "127.0.0.1" in lines[0], lines


@pytest.mark.parametrize("host", [None, "localhost", "127.0.0.1", "::1"])
def test_loopback_needs_no_key(host: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert validate(InferenceConfig, {"model": "m", "host": host}, "infer.yaml").host == host


def test_a_public_bind_with_a_key_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "k" * 32)
    cfg = validate(InferenceConfig, {"model": "m", "host": "10.0.0.5", "api_key_var": "MY_KEY"}, "infer.yaml")
    assert cfg.bind_host == "10.0.0.5"


def test_grpo_infer_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "i.yaml").write_text("model: m\nhost: 0.0.0.0\n")
    assert_refused_in_one_line(
        [str(BIN / "grpo-infer"), "i.yaml", "--dry-run"], "VLLM_API_KEY", "VLLM_API_KEY", cwd=tmp_path
    )


@pytest.mark.parametrize("name", ["bitsandbytes", "bnb", "NF4"])
def test_bitsandbytes_quantization_is_refused_in_one_line_naming_the_working_alternatives(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(InferenceConfig, {"model": "m", "quantization": name}, "infer.yaml")
    (line,) = str(err.value).splitlines()
    assert "vLLM 0.32 has no bitsandbytes (NF4) method" in line
    assert "set quantization fp8_per_block" in line and "qlora_bnb: true in train.yaml" in line
