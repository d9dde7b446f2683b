from __future__ import annotations

import subprocess
import sys


def test_transport_modules_do_not_import_torch_at_import_time() -> None:
    code = (
        "import sys\n"
        "import grpo.transport.batches.factory, grpo.transport.batches.zmq_transport, grpo.transport.batches.filesystem\n"
        "import grpo.transport.weights.filesystem, grpo.transport.weights.collective\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
