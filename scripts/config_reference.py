"""Write docs/config_reference.md from the config models (each field's doc lives beside it).

Run: .venv/bin/python scripts/config_reference.py   (tests check the file is up to date)
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

from grpo.config.across_files.derived import DERIVED
from grpo.config.across_files.shared_facts import SHARED_FACTS, File
from grpo.config.inference import InferenceConfig
from grpo.config.keys.field_table import field_rows
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.sections.openenv import OpenEnvArgs
from grpo.config.trainer import TrainerConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "config_reference.md"
ARGS_MODELS: list[tuple[str, str, type[BaseModel], str]] = [
    (
        "orch.yaml: `env[].args` of an `openenv:` block",
        'An env block `id: "openenv:http://HOST:PORT"` plays a running OpenEnv server; its `args` are these.',
        OpenEnvArgs,
        "env[].args.",
    ),
]
"""Loader arguments with a typed model of their own: (section title, intro line, model, key prefix)."""
FILES: list[tuple[File, type[BaseModel]]] = [
    ("infer", InferenceConfig),
    ("orch", OrchestratorConfig),
    ("train", TrainerConfig),
]


def _rows(file: File, model: type[BaseModel], out: list[str], prefix: str = "") -> None:
    for row in field_rows(file, model, prefix):
        cells = [f"`{row.key}`", row.type_name, row.default, row.doc]
        out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")


def render() -> str:
    lines = [
        "# Config reference",
        "",
        "Generated from the config models by `scripts/config_reference.py`; each entry is the field's own",
        "documentation (`grpo config show [train|infer|orch] --all` prints the same in a terminal). Unknown keys",
        "are errors (with a suggestion).",
        "",
        "Overrides: any key on the command line, `--key.subkey VALUE` (one-shot `grpo`: `--train.KEY`,",
        "`--infer.KEY`, `--orch.KEY`). Values are YAML, so JSON too (`'[1, 2]'`, `'{\"k\": 1}'`, `true`, `null`);",
        "several values after one key make a list (`--train.lora_target_modules q_proj v_proj`), one value",
        "for a list key a one-item list; a number indexes a list (`--orch.env.0.args.num_examples 5`, also",
        "`env[0]`; the next free index adds an item).",
        "",
        "One file: `grpo --config rl.yaml` (and `grpo-train`/`grpo-infer`/`grpo-orch --config rl.yaml`, each",
        "taking its section) reads `train:`, `infer:` and `orch:` sections, each what that file would hold,",
        "and at the top the shared keys below under their train.yaml names (`model`, `output_dir`, `seed`,",
        "`max_steps`, `lora_rank`, `transport_type`, `weight_broadcast: {type: ...}`, `ckpt: {interval: ...}`,",
        "...); a top-level value reaches every section that has the key. Every process of one rl.yaml",
        "resolves its section as the one-shot run does (the three sections reconciled). A dataset block's keys",
        "at the top (`dataset`, `reward_funcs`, `prompt_column`, ...) are the run's task, orch's one `env` block.",
        "",
        "Paths in a file are relative to that file's folder: `dataset: data.jsonl`, `reward_funcs:",
        "[rewards.py:exact]` (or `rewards:exact` with rewards.py beside the file), `tools`, an env `id`",
        "'envs.py:load_environment', `advantage.import_path`; image paths in the data are relative to the",
        "dataset file. Paths on the command line are relative to the working directory.",
        "",
        "Python: `grpo.train(model=..., dataset=..., reward_funcs=[fn], max_steps=..., orch={...})` or",
        "`grpo.train(config='rl.yaml', ...)` takes rl.yaml's top-level keys and sections as arguments",
        "(functions and a list of rows or a datasets.Dataset as they are) and returns the run directory.",
        "",
    ]
    lines += [
        "## Settings several files share",
        "",
        "One fact of a run under a key in each file that needs it, owned by",
        "`grpo.config.across_files.shared_facts`. One-shot `grpo`: an override of any of a fact's keys sets them all; a value",
        "set in one file reaches the files that leave it unset; two files setting different values stop the run",
        "with one line naming both. A value reaches the others before validation, so a required key (`model`)",
        "need be written in one file only.",
        "",
        "| fact | keys | multi-process |",
        "|---|---|---|",
    ]
    for fact in SHARED_FACTS:
        keys = ", ".join(f"{p.file}.yaml `{p.key}`" for p in fact.places)
        lines.append(f"| {fact.name} | {keys} | {fact.multi_process} |")
    lines += [
        "",
        "Derived where no file sets them (a co-located run, or one rl.yaml; grpo-train also takes its unset",
        "sequence_len, and the unset keys it compares above, from the run dir's orch.yaml):",
        "",
    ]
    lines += [f"- {derived.doc}" for derived in DERIVED]
    lines.append("")
    for file, model in FILES:
        lines += [f"## {file}.yaml", "", "| key | type | default | description |", "|---|---|---|---|"]
        _rows(file, model, lines)
        lines.append("")
    for title, intro, model, prefix in ARGS_MODELS:
        lines += [
            f"### {title}",
            "",
            intro,
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        _rows("orch", model, lines, prefix)
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else 1)
    OUT.write_text(text)
    print(f"wrote {OUT}")
