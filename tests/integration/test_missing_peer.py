"""A process whose peer never comes reports it by name after its timeout instead of hanging."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mp_harness import Launcher, assert_no_survivors, free_port, orch_config, train_config, write_yaml

pytestmark = [pytest.mark.slow]


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    try:
        yield launcher
        assert_no_survivors(launcher.tag)
    finally:
        launcher.kill_everything()


def test_orchestrator_without_inference_server_fails_with_the_url_after_its_timeout(
    launcher: Launcher, tiny_model_path: Path, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    cfg = orch_config(tiny_model_path, tmp_path / "run", url, lora=True)
    launcher.start("orch", "grpo-orch", write_yaml(tmp_path / "orch.yaml", cfg), "--client.timeout", "3")
    assert launcher.wait("orch", 120) == 1
    assert f"grpo-orch: error: inference server {url} unreachable after 3 s" in launcher.log("orch")


def test_trainer_without_orchestrator_fails_naming_the_run_dir_after_batch_timeout(
    launcher: Launcher, tiny_model_path: Path, tmp_path: Path
) -> None:
    cfg = train_config(tiny_model_path, tmp_path / "run", lora=True, batch_timeout=3)
    launcher.start("train", "grpo-train", write_yaml(tmp_path / "train.yaml", cfg))
    assert launcher.wait("train", 120) == 1
    log = launcher.log("train")
    assert "grpo-train: error: no run directory (a folder with configs/orch.yaml) appeared in" in log
    assert "Traceback" not in log
