"""The engine's shared-memory names are removed even when borrowing from them fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# In a child process that plays the engine and the trainer at once, and leaves with os._exit: the
# exporting process's own storage cleanup aborts once its name is gone, which the real engine (a
# process of its own) never reaches while the trainer holds the memory.
_SCENARIO = """
import os, sys, torch
from grpo.colocate.engine import borrow_base_weights
from grpo.inference.weight_handles import SHM_DIR, export_record

class EngineExportingOneTensor:  # stands in for ServerThread: one worker, a tensor the model lacks
    def __init__(self):
        self.tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        self.records = [export_record("not.a.weight.of.this.model", self.tensor)]
    def collective_rpc(self, method):
        return [self.records]

engine = EngineExportingOneTensor()
path = SHM_DIR / engine.records[0]["filename"].lstrip("/")
before = path.exists()
try:
    borrow_base_weights(engine, sys.argv[1])
    failed = False
except Exception:
    failed = True
print(before, failed, path.exists(), flush=True)
os._exit(0)
"""


def test_shared_memory_names_are_released_when_borrowing_fails(tiny_model_path: Path):
    out = subprocess.run(
        [sys.executable, "-c", _SCENARIO, str(tiny_model_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    existed, borrowing_failed, still_there = out.stdout.split()
    assert (existed, borrowing_failed, still_there) == ("True", "True", "False")
