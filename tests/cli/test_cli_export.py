"""`grpo export`: a trained run's policy out as a model transformers loads; every mistake one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trained_runs import train_and_publish

from grpo.transport.weights.filesystem import broadcast_dir
from grpo.utils.atomic import mark_stable

BIN = Path(sys.executable).parent


def _export(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "grpo"), "export", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def _assert_refused(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], lines


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("lora_run")
    train_and_publish(run_dir, tiny_model_path, lora=True)
    return run_dir


def _fake_full_run(run_dir: Path) -> Path:
    """A run dir whose step 1 holds (placeholder) full weights: enough for the checks before loading."""
    folder = broadcast_dir(run_dir, 1)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    mark_stable(folder)
    return run_dir


def test_export_writes_a_merged_model_that_transformers_loads_with_the_base_recorded_in_the_run(
    lora_run: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = _export(lora_run, tmp_path / "model")
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip()
        == f"wrote step 1 merged into {tiny_model_path} (bfloat16) to {tmp_path / 'model'}"
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_export_adapter_only_writes_the_peft_folder(
    lora_run: Path, tiny_model_path: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = _export(lora_run, tmp_path / "adapter", "--step", "1", "--adapter-only")
    assert result.returncode == 0, result.stderr
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path / "adapter")


def test_export_without_a_recorded_base_asks_for_base(lora_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(lora_run, run_dir)
    shutil.rmtree(run_dir / "configs")
    adapter_config = broadcast_dir(run_dir, 1) / "adapter_config.json"
    config = json.loads(adapter_config.read_text())
    adapter_config.write_text(json.dumps({**config, "base_model_name_or_path": str(tmp_path / "gone")}))
    _assert_refused(_export(run_dir, tmp_path / "out"), "pass --base MODEL")


@pytest.mark.parametrize(
    ("case", "args", "expected"),
    [
        ("missing run dir", ["{tmp}/nope", "{tmp}/out"], "pass the output_dir of a training run"),
        ("nothing published", ["{tmp}", "{tmp}/out"], "which holds broadcasts/"),
        ("unknown step", ["{full}", "{tmp}/out", "--step", "7"], "published steps: 1"),
        ("adapter of a full run", ["{full}", "{tmp}/out", "--adapter-only"], "leave out --adapter-only"),
        ("non-empty output", ["{full}", "{tmp}/busy"], "pass --force"),
        ("the run dir as output", ["{full}", "{full}", "--force"], "holds the run directory"),
        ("unknown dtype", ["{full}", "{tmp}/out", "--dtype", "int4"], "choose one of bfloat16"),
        ("no output given", ["{full}"], "Missing argument"),
        ("public without a push", ["{full}", "{tmp}/out", "--public"], "add --push-to-hub REPO"),
    ],
)
def test_export_refuses_bad_inputs_in_one_line(
    case: str, args: list[str], expected: str, tmp_path: Path
) -> None:
    full = _fake_full_run(tmp_path / "full")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep")
    argv = [a.format(tmp=tmp_path, full=full) for a in args]
    _assert_refused(_export(*argv), expected)


def test_push_to_hub_is_skipped_offline_and_fails_in_one_line_without_a_hub(
    lora_run: Path, tmp_path: Path
) -> None:
    offline = _export(
        lora_run, tmp_path / "a", "--adapter-only", "--push-to-hub", "me/model", env={"HF_HUB_OFFLINE": "1"}
    )
    assert offline.returncode == 0, offline.stderr
    assert (
        offline.stdout.strip().splitlines()[-1].startswith("skipped --push-to-hub me/model: HF_HUB_OFFLINE")
    )

    # A closed local port stands for an unreachable hub: no network is used.
    unreachable = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_test"}
    result = _export(lora_run, tmp_path / "b", "--adapter-only", "--push-to-hub", "me/model", env=unreachable)
    _assert_refused(result, "push to me/model failed")
    assert (tmp_path / "b" / "adapter_config.json").exists()  # the export itself stays
