"""Full-weight updates into a CPU engine whose MoE experts vLLM packed are refused, before anything
is loaded: the expert kernel reads a packed copy that a plain load does not rebuild."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from grpo.inference.vllm_compat.cpu_weights import refuse_full_updates_of_packed_experts
from grpo.inference.worker_extension import WorkerExtension


class _Experts(torch.nn.Module):
    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(4, 8, 4), requires_grad=False)
        if packed:  # what keep_dense_cpu_experts leaves beside the kernel's packed copy
            self.w13_weight_dense = torch.nn.Parameter(torch.zeros(4, 8, 4), requires_grad=False)


class _Model(torch.nn.Module):
    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.experts = _Experts(packed)
        self.loaded: list[str] = []

    def load_weights(self, weights) -> None:
        self.loaded += [name for name, _ in weights]


class _Worker:
    def __init__(self, model: _Model) -> None:
        self.model = model

    def _grpo_model(self) -> _Model:
        return self.model


def test_a_model_with_packed_cpu_experts_refuses_full_updates_naming_lora_and_gpu() -> None:
    with pytest.raises(ValueError, match=r"mixture-of-experts.*CPU engine.*lora: true.*GPU"):
        refuse_full_updates_of_packed_experts(_Model(packed=True))
    refuse_full_updates_of_packed_experts(_Model(packed=False))  # experts the kernel reads as loaded


@pytest.mark.parametrize("packed", [True, False])
def test_a_full_weight_load_from_a_folder_loads_nothing_into_packed_experts(
    tmp_path: Path, packed: bool
) -> None:
    save_file(
        {"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(2, 4)}, str(tmp_path / "w.safetensors")
    )
    model = _Model(packed)
    load = WorkerExtension.load_weights_from_path
    if packed:
        with pytest.raises(ValueError, match="mixture-of-experts"):
            load(_Worker(model), str(tmp_path))  # type: ignore[arg-type]
        assert model.loaded == []
    else:
        pytest.importorskip("vllm")  # the load then repacks vLLM's CPU linears
        assert load(_Worker(model), str(tmp_path)) == 1  # type: ignore[arg-type]
        assert model.loaded == ["model.layers.0.mlp.experts.0.gate_proj.weight"]
