"""Where the trainer's frozen base weights come from (the seam for co-located weight sharing).

A `BaseWeightSource` names the HF model folder (config, tokenizer, and the weights on disk) and may
hand over existing tensors, by HF state-dict name, to use as frozen base weights as they are:
the built model's parameter then shares the tensor's storage (no copy). It may also hand over
quantized linear weights (FP8 data + scales) by HF module name: those linears become frozen
dequantize-per-matmul layers over the given tensors (grpo.trainer.hf.quantized_base). `DiskWeights`
hands over nothing; the co-located mode supplies tensors borrowed from the inference engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from grpo.trainer.quantized_weights import FP8BlockWeight, NF4Weight


class BaseWeightSource(Protocol):
    @property
    def model_path(self) -> Path:
        """Local HF folder with config.json, tokenizer and safetensors weights."""
        ...

    def borrowed_tensors(self) -> Mapping[str, torch.Tensor]:
        """HF state-dict name (e.g. `model.layers.0.self_attn.q_proj.weight`) -> tensor to use as
        that frozen weight by identity. Tensors must already have the trainer's dtype and device."""
        ...

    def borrowed_quantized(self) -> Mapping[str, FP8BlockWeight | NF4Weight]:
        """HF module name (e.g. `model.layers.0.self_attn.q_proj`) -> quantized weight to use as that
        frozen linear, dequantized per matmul. Tensors must already be on the trainer's device."""
        ...

    @property
    def engine_compiled(self) -> bool:
        """Whether the vLLM engine that samples for this trainer runs its model compiled (vLLM's
        default) rather than eagerly: the two round 16-bit activations differently, and a 16-bit
        trainer follows the one named here (grpo.trainer.hf.vllm_numerics)."""
        ...


class DiskWeights:
    """Everything from the model folder on disk."""

    def __init__(self, model_path: str | Path) -> None:
        self._model_path = Path(model_path)

    @property
    def model_path(self) -> Path:
        return self._model_path

    def borrowed_tensors(self) -> Mapping[str, torch.Tensor]:
        return {}

    def borrowed_quantized(self) -> Mapping[str, FP8BlockWeight | NF4Weight]:
        return {}

    @property
    def engine_compiled(self) -> bool:
        return True  # a separate server's mode is not known here: vLLM's default


class BorrowedWeights:
    """The folder on disk, with some weights replaced by tensors that already live elsewhere."""

    def __init__(
        self,
        model_path: str | Path,
        tensors: Mapping[str, torch.Tensor],
        quantized: Mapping[str, FP8BlockWeight | NF4Weight] | None = None,
        engine_compiled: bool = True,
    ) -> None:
        self._model_path = Path(model_path)
        self._tensors = dict(tensors)
        self._quantized = dict(quantized or {})
        self._engine_compiled = engine_compiled

    @property
    def model_path(self) -> Path:
        return self._model_path

    def borrowed_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def borrowed_quantized(self) -> Mapping[str, FP8BlockWeight | NF4Weight]:
        return self._quantized

    @property
    def engine_compiled(self) -> bool:
        return self._engine_compiled


def install_borrowed(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make each named parameter of `model` a frozen Parameter over the given tensor (same storage)."""
    import torch

    for name, tensor in tensors.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        current = getattr(module, attr, None)
        if not isinstance(current, torch.nn.Parameter):
            raise ValueError(f"borrowed tensor {name} does not name a parameter of the model")
        if current.shape != tensor.shape or current.dtype != tensor.dtype:
            raise ValueError(
                f"borrowed tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, the model expects "
                f"{tuple(current.shape)} {current.dtype}; hand over tensors in the trainer's dtype"
            )
        setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))
