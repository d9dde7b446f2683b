"""Run one grpo entry point up to vLLM's engine start, on a make-believe CUDA machine, recording
every torch call that would initialise CUDA here or poison a later fork (run by test_device.py).

`python cuda_entry_probe.py REPORT.json MODULE [ARGV...]` calls MODULE.main() with ARGV. torch is
made to look like a CUDA build with one device that NVML sees; `torch._C._cuda_getDeviceCount`
(what `torch.cuda.is_available()` calls: it registers the bad-fork handler) and
`torch.cuda._lazy_init` (what every real CUDA call goes through) are recorded with the code that
called them. When vLLM's API server is about to start its engine (`build_async_engine_client`,
the moment it forks) the calls made by grpo's own code are written to REPORT.json and the process
exits 0; vLLM's own calls are left to vLLM. A run that never reaches the engine exits otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

_GRPO_SPEC = importlib.util.find_spec("grpo")
assert _GRPO_SPEC is not None and _GRPO_SPEC.origin is not None
GRPO_SRC = str(Path(_GRPO_SPEC.origin).resolve().parent)
"""The grpo package being tested (resolved: it may be imported through a symlink)."""
TORCH_DIR = str(Path(torch.__file__).parent)

calls: list[dict[str, str]] = []


def _caller() -> str:
    """The first frame outside torch and this file: who asked torch."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(TORCH_DIR) and frame.filename != __file__:
            return f"{Path(frame.filename).resolve()}:{frame.lineno}"
    return "?"


def _record(what: str) -> None:
    calls.append({"call": what, "caller": _caller()})


def _device_count_in_runtime() -> int:
    _record("torch._C._cuda_getDeviceCount (poisons fork)")
    return 1


def _lazy_init() -> None:
    _record("torch.cuda._lazy_init (initialises CUDA)")


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    torch.cuda._lazy_init()
    return 70 * 2**30, 80 * 2**30


def _current_device() -> int:
    torch.cuda._lazy_init()
    return 0


def _device_name(device: Any = None) -> str:
    torch.cuda._lazy_init()
    return "Fake H100"


def install_fake_cuda() -> None:
    torch.cuda._is_compiled = lambda: True  # type: ignore[attr-defined]
    torch.cuda._device_count_nvml = lambda: 1  # type: ignore[attr-defined]
    torch._C._cuda_getDeviceCount = _device_count_in_runtime  # type: ignore[attr-defined]
    torch.cuda._lazy_init = _lazy_init  # type: ignore[attr-defined]
    torch.cuda.mem_get_info = _mem_get_info  # type: ignore[assignment]
    torch.cuda.current_device = _current_device  # type: ignore[assignment]
    torch.cuda.get_device_name = _device_name  # type: ignore[assignment]


def stop_at_engine_start(report: Path) -> None:
    from vllm.entrypoints.launchers.api_server import entry

    def build_async_engine_client(*args: Any, **kwargs: Any) -> Any:
        by_grpo = [c for c in calls if c["caller"].startswith(GRPO_SRC)]
        multiproc = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        report.write_text(
            json.dumps({"grpo_calls": by_grpo, "all_calls": calls, "multiproc_method": multiproc})
        )
        sys.stdout.flush()
        os._exit(0)

    entry.build_async_engine_client = build_async_engine_client


def main() -> None:
    report, module, *argv = sys.argv[1:]
    # vLLM (and torch's compiler, which it imports) first, as the CPU build they are: a CUDA build's
    # import paths need CUDA symbols this torch lacks. grpo is imported after, under the fakes.
    stop_at_engine_start(Path(report))
    # `import vllm` sets this, which makes torch.cuda.is_available() ask NVML from then on; grpo
    # asks before it imports vLLM (config checks, the memory plan), so it must not count on it.
    os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    install_fake_cuda()
    sys.argv = [module, *argv]
    importlib.import_module(module).main()
    raise SystemExit(f"{module} ended without starting vLLM's engine")


if __name__ == "__main__":
    main()
