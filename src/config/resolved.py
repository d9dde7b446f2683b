"""The configs a run actually used, as YAML: printed by --dry-run and stored in `{run_dir}/configs/`.

Here rather than in the CLI because the co-located runner writes them too, and nothing imports
the CLI (docs/design.md, import rules).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from grpo.utils.atomic import write_text_atomic


def dump_yaml(config: BaseModel) -> str:
    import yaml

    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def write_resolved_configs(run_dir: Path, configs: dict[str, BaseModel]) -> None:
    """Store the configs a run actually used next to its outputs (for resume and for the record)."""
    for name, config in configs.items():
        write_text_atomic(run_dir / "configs" / f"{name}.yaml", dump_yaml(config))
