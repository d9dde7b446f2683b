"""The announcement of a policy version whose full weights travel over a collective, not the disk.

With `weight_broadcast.type: nccl` (full fine-tuning) the trainer still publishes
`{run_dir}/broadcasts/step_{v}/` with STABLE last, so the orchestrator's policy watcher sees the
new version as usual; the folder holds only `collective.json` (this module) instead of the
weights. The orchestrator reads it and asks the inference servers to receive version v over the
collective (grpo.transport.weights.collective) while the trainer sends it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLLECTIVE_MANIFEST = "collective.json"


def write_collective_manifest(
    folder: str | Path, version: int, host: str, port: int, num_tensors: int, num_bytes: int
) -> None:
    """Describe version `version` in `folder` (a staging folder: STABLE comes after)."""
    from grpo.utils.atomic import write_json_atomic

    write_json_atomic(
        Path(folder) / COLLECTIVE_MANIFEST,
        {
            "version": version,
            "trainer_address": f"{host}:{port}",
            "num_tensors": num_tensors,
            "num_bytes": num_bytes,
        },
    )


def read_collective_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The announcement in a published broadcast folder, or None when it holds weights on disk."""
    path = Path(folder) / COLLECTIVE_MANIFEST
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict) or not isinstance(manifest.get("version"), int):
        raise ValueError(
            f"{path} is not a weight announcement (no integer 'version'); was it edited by hand?"
        )
    return manifest
