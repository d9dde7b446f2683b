"""docs/config_reference.md is generated from the config models and must match them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_config_reference_is_up_to_date() -> None:
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "config_reference.py"), "--check"])
    assert result.returncode == 0, "docs/config_reference.md is stale: run python scripts/config_reference.py"
