"""train.yaml: a zmq socket or a weight collective open to other machines needs a shared secret."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from one_line_refusal import assert_refused_in_one_line

from grpo.config.errors import ConfigError
from grpo.config.loading import validate
from grpo.config.trainer import TrainerConfig

BIN = Path(sys.executable).parent


def _zmq(host: str) -> dict[str, object]:
    return {"model": "m", "transport_type": "zmq", "zmq_host": host}


def test_a_public_zmq_bind_without_a_secret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_ZMQ_SECRET", raising=False)
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, _zmq("0.0.0.0"), "train.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "export GRPO_ZMQ_SECRET=" in lines[0] and "127.0.0.1" in lines[0], lines


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
def test_loopback_needs_no_secret(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_ZMQ_SECRET", raising=False)
    assert validate(TrainerConfig, _zmq(host), "train.yaml").zmq_host == host


def test_a_public_bind_with_a_secret_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_SECRET", "x" * 32)
    cfg = validate(TrainerConfig, {**_zmq("10.0.0.5"), "zmq_secret_env": "MY_SECRET"}, "train.yaml")
    assert cfg.zmq_secret_env == "MY_SECRET"


def test_grpo_train_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("model: m\ntransport_type: zmq\nzmq_host: 0.0.0.0\n")
    assert_refused_in_one_line(
        [str(BIN / "grpo-train"), "t.yaml", "--dry-run"], "GRPO_ZMQ_SECRET", "GRPO_ZMQ_SECRET", cwd=tmp_path
    )


def _collective(host: str) -> dict[str, object]:
    return {"model": "m", "lora": False, "weight_broadcast": {"type": "nccl", "host": host, "num_servers": 2}}


def test_a_public_weight_collective_without_a_secret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_WEIGHTS_SECRET", raising=False)
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, _collective("0.0.0.0"), "train.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "export GRPO_WEIGHTS_SECRET=" in lines[0] and "127.0.0.1" in lines[0], lines


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
def test_a_loopback_weight_collective_needs_no_secret(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_WEIGHTS_SECRET", raising=False)
    cfg = validate(TrainerConfig, _collective(host), "train.yaml")
    assert cfg.weight_broadcast.type == "nccl" and cfg.weight_broadcast.num_servers == 2


def test_a_public_weight_collective_with_a_secret_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_WEIGHTS_SECRET", "w" * 32)
    block = {"type": "nccl", "host": "10.0.0.5", "secret_env": "MY_WEIGHTS_SECRET"}
    train = {"model": "m", "lora": False, "weight_broadcast": block}
    cfg = validate(TrainerConfig, train, "train.yaml")
    assert cfg.weight_broadcast.type == "nccl" and cfg.weight_broadcast.secret_env == "MY_WEIGHTS_SECRET"


def test_grpo_train_refuses_a_public_weight_collective_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text("model: m\nlora: false\nweight_broadcast: {type: nccl, host: 0.0.0.0}\n")
    assert_refused_in_one_line(
        [str(BIN / "grpo-train"), "t.yaml", "--dry-run"],
        "GRPO_WEIGHTS_SECRET",
        "GRPO_WEIGHTS_SECRET",
        cwd=tmp_path,
    )


@pytest.mark.parametrize("level", [0, 2, 3])
def test_a_zero_level_other_than_1_is_refused_since_it_would_change_nothing(level: int) -> None:
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, {"model": "m", "zero_level": level}, "train.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and f"zero_level {level} would change nothing" in lines[0], lines
    assert validate(TrainerConfig, {"model": "m", "zero_level": 1}, "train.yaml").zero_level == 1


def test_qerl_noise_with_full_weights_over_the_collective_is_refused_in_one_line() -> None:
    noisy = {**_collective("127.0.0.1"), "noise_scheduler": {"enabled": True}}
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, noisy, "train.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines
    assert "noise_scheduler.enabled" in lines[0] and "weight_broadcast type filesystem" in lines[0], lines


def test_qerl_noise_loads_where_the_norms_travel_as_files() -> None:
    """LoRA adapters (and their noisy norms) go through broadcasts/ even with weight_broadcast nccl."""
    lora = {**_collective("127.0.0.1"), "lora": True, "noise_scheduler": {"enabled": True}}
    assert validate(TrainerConfig, lora, "train.yaml").noise_scheduler.enabled
    files = {"model": "m", "lora": False, "noise_scheduler": {"enabled": True}}
    assert validate(TrainerConfig, files, "train.yaml").weight_broadcast.type == "filesystem"


def test_the_unimplemented_nvfp4_recipe_is_refused_at_load_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, {"model": "m", "recipe": "nvfp4"}, "train.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "not implemented" in lines[0] and "set recipe: bf16" in lines[0], lines


@pytest.mark.parametrize("recipe", ["fp8-hybrid", "fp8_hybrid"])
def test_the_fp8_hybrid_recipe_loads_under_either_spelling(recipe: str) -> None:
    assert validate(TrainerConfig, {"model": "m", "recipe": recipe}, "train.yaml").recipe == "fp8_hybrid"


@pytest.mark.parametrize("quantization", ["qlora_bnb", "qlora_fp8"])
def test_fp8_hybrid_over_a_quantized_base_is_refused_naming_both(quantization: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, {"model": "m", "recipe": "fp8_hybrid", quantization: True}, "train.yaml")
    line = str(err.value)
    assert "\n" not in line and "recipe fp8_hybrid" in line and f"remove {quantization}" in line
