"""A run's configs as a user writes them: a minimal set, one rl.yaml, list and indexed overrides,
and `grpo config show` (through the commands, with --dry-run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MINIMAL = REPO / "examples" / "minimal"
BIN = Path(sys.executable).parent
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / argv[0]), *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _resolved(stdout: str) -> dict[str, Any]:
    """The `# ---- NAME.yaml (resolved) ----` documents of a --dry-run, by name."""
    out = {}
    for document in stdout.split("# ---- ")[1:]:
        title, _, body = document.partition("\n")
        if title.endswith("(resolved) ----"):
            out[title.split(".yaml")[0]] = yaml.safe_load(body.split("\n# ")[0].split("memory plan")[0])
    return out


def test_a_minimal_set_with_the_model_in_train_yaml_alone_passes_a_dry_run_with_list_overrides(
    tmp_path: Path,
) -> None:
    (tmp_path / "train.yaml").write_text(f"model: {MODEL}\n")
    (tmp_path / "infer.yaml").write_text("")
    (tmp_path / "orch.yaml").write_text("env:\n  - id: short-answer\n")
    result = _run(
        "grpo", "--train", "train.yaml", "--infer", "infer.yaml", "--orch", "orch.yaml", "--dry-run",
        "--train.lora_rank", "32", "--train.lora_target_modules", "q_proj", "v_proj",
        "--orch.env.0.args.num_examples", "5",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    resolved = _resolved(result.stdout)
    assert resolved["infer"]["model"] == resolved["orch"]["model"]["name"] == MODEL
    assert resolved["train"]["sequence_len"] == resolved["orch"]["seq_len"]
    assert resolved["train"]["lora_target_modules"] == ["q_proj", "v_proj"]
    assert resolved["infer"]["max_lora_rank"] == resolved["orch"]["model"]["lora_rank"] == 32
    assert resolved["orch"]["env"][0]["args"] == {"num_examples": 5}


def test_the_shipped_minimal_set_and_its_rl_yaml_resolve_alike(tmp_path: Path) -> None:
    three = _run(
        "grpo", *(a for n in ("train", "infer", "orch") for a in (f"--{n}", str(MINIMAL / f"{n}.yaml"))), "--dry-run",
        cwd=tmp_path,
    )  # fmt: skip
    one = _run("grpo", "--config", str(MINIMAL / "rl.yaml"), "--dry-run", cwd=tmp_path)
    assert three.returncode == 0 and one.returncode == 0, (three.stderr, one.stderr)
    # The memory plan sizes these from the memory available at each start, which moves between runs.
    planned = ("micro_batch_tokens", "activation_memory_gib")
    resolved = [_resolved(run.stdout) for run in (three, one)]
    for documents in resolved:
        for document in documents.values():
            for key in planned:
                document.pop(key, None)
    assert resolved[0] == resolved[1]


def test_each_process_takes_its_section_of_rl_yaml(tmp_path: Path) -> None:
    rl = str(MINIMAL / "rl.yaml")
    for command, name in (("grpo-train", "train"), ("grpo-infer", "infer"), ("grpo-orch", "orch")):
        result = _run(command, "--config", rl, "--dry-run", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert list(_resolved(result.stdout)) == [name]


def test_config_show_all_lists_every_key_with_its_default_and_doc(tmp_path: Path) -> None:
    result = _run("grpo", "config", "show", "train", "--all", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "  lora_target_modules: list[str] = ['q_proj'" in result.stdout
        and "wrapped with LoRA" in result.stdout
    )
    assert "[loss]" in result.stdout and "  loss.kl_tau: float = 0.0" in result.stdout
    help_text = _run("grpo-train", "--help", cwd=tmp_path).stdout
    assert "grpo config show train" in help_text and "--config" in help_text
