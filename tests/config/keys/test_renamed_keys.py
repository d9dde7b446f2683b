"""train.yaml names that meant something else to TRL users: gradient_accumulation_steps is read as
micro_batches_per_backward for one release (with a warning), per_device_train_batch_size is a
backend megatron key only."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from one_line_refusal import assert_refused_in_one_line

from grpo.config.errors import ConfigError
from grpo.config.keys import renamed_keys
from grpo.config.loading import validate
from grpo.config.trainer import TrainerConfig

BIN = Path(sys.executable).parent


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_logged(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    monkeypatch.setattr(renamed_keys, "_warned", set())
    handler = _Lines()
    logger = logging.getLogger("grpo.config")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def test_the_old_accumulation_key_loads_as_micro_batches_per_backward_with_one_warning(
    warnings_logged: list[str],
) -> None:
    for _ in range(2):  # a run validates its configs more than once
        cfg = validate(TrainerConfig, {"model": "m", "gradient_accumulation_steps": 2}, "train.yaml")
        assert cfg.micro_batches_per_backward == 2
    assert len(warnings_logged) == 1
    assert "gradient_accumulation_steps is now micro_batches_per_backward" in warnings_logged[0]
    assert "\n" not in warnings_logged[0]


def test_the_new_name_loads_without_a_warning(warnings_logged: list[str]) -> None:
    cfg = validate(TrainerConfig, {"model": "m", "micro_batches_per_backward": 3}, "train.yaml")
    assert cfg.micro_batches_per_backward == 3 and warnings_logged == []


def test_both_names_at_once_are_refused_naming_the_one_to_keep() -> None:
    data = {"model": "m", "gradient_accumulation_steps": 2, "micro_batches_per_backward": 3}
    with pytest.raises(ConfigError, match="set only micro_batches_per_backward"):
        validate(TrainerConfig, data, "train.yaml")


def test_rows_per_micro_batch_are_refused_under_backend_hf_naming_micro_batch_tokens() -> None:
    with pytest.raises(ConfigError) as err:
        validate(TrainerConfig, {"model": "m", "per_device_train_batch_size": 1}, "train.yaml")
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and "backend megatron key" in lines[0] and "micro_batch_tokens" in lines[0]


def test_rows_per_micro_batch_size_backend_megatron_micro_batches() -> None:
    cfg = TrainerConfig(model="m", backend="megatron", lora=False, per_device_train_batch_size=3)
    assert cfg.micro_batch_token_budget == 3 * cfg.sequence_len


def test_a_backend_hf_micro_batch_holds_one_row_unless_micro_batch_tokens_says_otherwise() -> None:
    assert TrainerConfig(model="m", sequence_len=512).micro_batch_token_budget == 512
    assert TrainerConfig(model="m", micro_batch_tokens=2000).micro_batch_token_budget == 2000


def test_grpo_train_refuses_rows_per_micro_batch_under_backend_hf_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.yaml").write_text("model: m\nper_device_train_batch_size: 2\n")
    argv = [str(BIN / "grpo-train"), str(tmp_path / "train.yaml"), "--dry-run"]
    assert_refused_in_one_line(argv, "GRPO_ZMQ_SECRET", "remove it, or set micro_batch_tokens", cwd=tmp_path)


def test_a_resolved_backend_hf_config_dumped_whole_loads_again() -> None:
    """Co-located replicas read the run dir's configs/train.yaml, every key written."""
    cfg = TrainerConfig(model="m", gradient_accumulation_steps=2)
    assert TrainerConfig.model_validate(cfg.model_dump(mode="json")) == cfg
