"""backend megatron on a model or launch it cannot train: one line and exit 2 at once, before
grpo-train waits for the orchestrator (without --dry-run: it would otherwise wait for ever) and
before `grpo` starts vLLM (with --dry-run, which starts nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo"
BIN = Path(sys.executable).parent
_SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def _model(path: Path, family: str, **fields: Any) -> Path:
    """A model folder holding only config.json: enough for every check that runs before weights load."""
    import transformers

    architecture = "GPT2LMHeadModel" if family == "GPT2" else f"{family}ForCausalLM"
    config = getattr(transformers, f"{family}Config")(**fields, architectures=[architecture])
    config.save_pretrained(path)
    return path


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _assert_one_line(result: subprocess.CompletedProcess[str], prog: str, expected: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(errors) == 1 and expected in errors[0], result.stderr


@pytest.mark.parametrize(
    ("family", "fields", "train", "expected"),
    [
        ("Mistral", {**_SHAPE, "sliding_window": 512}, {}, "sliding_window"),
        ("Llama", {**_SHAPE, "hidden_act": "gelu"}, {}, "hidden_act"),
        ("GPT2", {}, {}, "GPT2LMHeadModel"),
        ("Llama", _SHAPE, {"gpus": 2}, "torchrun --nproc_per_node 2"),
    ],
    ids=["sliding window", "gelu mlp", "gpt2", "gpus without torchrun"],
)
def test_grpo_train_refuses_before_waiting_for_the_orchestrator(
    family: str, fields: dict[str, Any], train: dict[str, Any], expected: str, tmp_path: Path
) -> None:
    import yaml

    model = _model(tmp_path / "model", family, **fields)
    config = {"model": str(model), "backend": "megatron", "lora": False, "output_dir": "run", **train}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(config))
    _assert_one_line(_run(["grpo-train", "t.yaml"], tmp_path), "grpo-train", expected)


def test_grpo_train_without_megatron_core_names_the_extra(tmp_path: Path) -> None:
    import yaml

    # A `megatron` package without `core` ahead of the installed one: megatron-core is "not installed".
    (tmp_path / "shadow" / "megatron").mkdir(parents=True)
    (tmp_path / "shadow" / "megatron" / "__init__.py").write_text("")
    pythonpath = os.pathsep.join(p for p in (str(tmp_path / "shadow"), os.environ.get("PYTHONPATH")) if p)
    model = _model(tmp_path / "model", "Llama", **_SHAPE)
    config = {"model": str(model), "backend": "megatron", "lora": False, "output_dir": "run"}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(config))
    result = _run(["grpo-train", "t.yaml"], tmp_path, env={"PYTHONPATH": pythonpath})
    _assert_one_line(result, "grpo-train", "pip install 'grpo-rl[megatron]'")


def test_colocated_grpo_refuses_an_unsupported_model_before_the_engine_starts(tmp_path: Path) -> None:
    model = str(_model(tmp_path / "model", "Mistral", **_SHAPE, sliding_window=64))  # demo: 512 tokens
    configs = [
        arg for name in ("train", "infer", "orch") for arg in (f"--{name}", str(DEMO / f"{name}.yaml"))
    ]
    overrides = ["--train.backend", "megatron", "--train.lora", "false", "--orch.model.lora_adapter", "null"]
    models = ["--train.model", model, "--infer.model", model]
    result = _run(["grpo", *configs, *overrides, *models, "--dry-run"], tmp_path)
    _assert_one_line(result, "grpo", "sliding_window")
