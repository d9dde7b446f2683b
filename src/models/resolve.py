"""Turn a model id or path into a local folder, offline first.

Order: a local path; the HF cache; grpo's embedded store; a hub download. The first three
need no network, so configs can say `model: HuggingFaceTB/SmolLM2-135M-Instruct` on a machine
that never reaches the hub.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from grpo.models import embedded
from grpo.utils.errors import UserError

Source = Literal["local", "hf-cache", "embedded", "hub"]


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    """What the config said."""
    path: Path
    """A local folder with config.json and weights."""
    source: Source
    note: str = ""
    """Provenance worth logging (e.g. that the weights are a dequantized copy)."""

    def describe(self) -> str:
        from grpo.models.moe import describe_moe

        text = f"model {self.name} -> {self.path} ({self.source})"
        text = f"{text}: {self.note}" if self.note else text
        moe = describe_moe(self.path) if (self.path / "config.json").exists() else None
        return f"{text}; {moe}" if moe else text


def resolve_model(name: str, allow_download: bool = True, build_embedded: bool = True) -> ResolvedModel:
    """Find `name` locally, or raise UserError saying where it looked and what to do."""
    local = Path(name).expanduser()
    if local.exists():
        if not (local / "config.json").exists():
            raise UserError(f"model path {local} exists but has no config.json; point at a HF model folder")
        prov = embedded.provenance(local)
        return ResolvedModel(name, local.resolve(), "local", note=str(prov["note"]) if prov else "")
    if name.startswith(("/", "./", "../", "~")):
        raise UserError(f"model path {name} does not exist")

    cached = _from_hf_cache(name)
    if cached is not None:
        return ResolvedModel(name, cached, "hf-cache")

    if name == embedded.EMBEDDED_MODEL_ID and (embedded.is_built() or build_embedded):
        path = embedded.build()
        prov = embedded.provenance(path) or {}
        return ResolvedModel(name, path, "embedded", note=str(prov.get("note", "")))

    if allow_download and os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True"):
        try:
            from huggingface_hub import snapshot_download

            return ResolvedModel(name, Path(snapshot_download(name)), "hub")
        except Exception as exc:  # hub errors are many and version-specific; all mean "not here"
            reason = f"hub download failed ({type(exc).__name__})"
    else:
        reason = "hub downloads are off"
    raise UserError(
        f"model '{name}' not found as a local path, in the HF cache or in the embedded store, and {reason}; "
        f"give a local HF folder path, or use the embedded default '{embedded.EMBEDDED_MODEL_ID}'"
    )


def _from_hf_cache(name: str) -> Path | None:
    if name.count("/") != 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    if isinstance(found, str):
        return Path(found).parent
    return None


def log_model(resolved: ResolvedModel) -> None:
    """One log line saying which model was found where (every command that loads one says it)."""
    from grpo.utils.logging import get_logger

    get_logger("model").info(resolved.describe())
