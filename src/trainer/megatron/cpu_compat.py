"""Run megatron-core's CUDA-only code paths on CPU (used only where CUDA is absent).

megatron-core assumes a GPU in a few places that have nothing to do with the arithmetic: its
gradient buffers, optimizers, gradient clipping, RoPE, and the pipeline schedule and its
point-to-point receive buffers allocate with `device="cuda"` or
`torch.cuda.current_device()`, check `param.type() == "torch.cuda.FloatTensor"`, move state with
`.cuda()`, and order work with CUDA streams and `torch.cuda.synchronize()`. Redirecting exactly
those to the CPU lets CI exercise the same DDP, DistributedOptimizer and model code that runs on
GPUs, with gloo as the collective backend (gloo's batched isend/irecv serves the schedule).

Two parts:
- `patch_cuda_module()`: process-wide, once: `torch.cuda.current_device()` names the CPU, streams
  and synchronisation are no-ops, megatron-core's RNG tracker (CUDA generator states, forked
  for dropout) is one that forks nothing, activation recomputation saves no CUDA generator, and
  the all-to-all MoE dispatcher's split sizes become numpy arrays as on a GPU. On a machine without CUDA these functions could only raise, so
  nothing else that runs in the process loses behaviour.
- `on_cpu()`: a thread-local TorchFunctionMode for the trainer's Megatron calls: a `device` that
  names CUDA becomes the CPU, `.cuda()` is the identity, and `Tensor.type()` reports the CUDA type
  name megatron-core's dtype checks expect.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def needed() -> bool:
    import torch

    return not torch.cuda.is_available()


class _Event:
    """Stands in for torch.cuda.Event: work on the CPU is already done when it is recorded."""

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """Stands in for torch.cuda.Stream: work on the CPU is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _Event:
        return _Event()


@functools.cache
def patch_cuda_module() -> None:
    """Make the torch.cuda functions megatron-core calls harmless on a CPU-only machine (once)."""
    import torch

    assert needed(), "the CPU compatibility layer is for machines without CUDA"
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.default_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    _install_rng_tracker()
    _split_sizes_as_numpy()
    import warnings

    # Advice on CUDA's hardware queues for overlapping the tensor-parallel all-reduce: no CUDA here.
    warnings.filterwarnings("ignore", message="When using async grad allreduce it is recommended to set")


class _CpuRngTracker:
    """Stands in for megatron-core's CUDA RNG tracker, whose states are CUDA generator states.
    Forking it only matters for dropout inside tensor-parallel regions, and the trainer's dropout is
    0, so the CPU's one generator serves."""

    def reset(self) -> None:
        pass

    def get_states(self) -> dict[str, Any]:
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        pass

    def add(self, name: str, seed: int) -> None:
        pass

    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random

    random._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recomputation saves and restores the CUDA generator beside the CPU's (which it
    # handles itself): without CUDA there is none.
    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None


def _split_sizes_as_numpy() -> None:
    """megatron-core's all-to-all token dispatcher turns its split sizes into numpy arrays as it
    copies them off the GPU (maybe_move_tensor_to_cpu, as_numpy) and later uses them as numpy
    arrays; a CPU tensor is left as it is, so convert those on the CPU too."""
    import torch
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu

    def to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _is_cuda_device(device: Any) -> bool:
    import torch

    if isinstance(device, int) and not isinstance(device, bool):
        return True  # megatron-core passes torch.cuda.current_device()'s ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


@functools.cache
def _mode_class() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return _CUDA_TYPE_NAMES.get(name, name)
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CudaToCpu


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Megatron calls inside run on the CPU (a no-op where CUDA is present)."""
    if not needed():
        yield
        return
    patch_cuda_module()
    with _mode_class()():
        yield
