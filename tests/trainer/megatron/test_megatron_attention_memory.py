"""What backend megatron's attention keeps for backward per score, pinned against megatron-core's
own local DotProductAttention (the memory plan's `attention scores` row counts it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo[megatron])")

from trainer_batches import make_row

from grpo.colocate.memory_plan import ATTENTION_SCORE_KEPT_BYTES
from grpo.config.trainer import TrainerConfig
from grpo.trainer.packing import build_micro_batch


def test_bf16_attention_keeps_an_fp32_and_a_bf16_copy_of_every_layers_scores(
    megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    # The compute dtype on a GPU (this CPU would pick float32).
    monkeypatch.setattr("grpo.trainer.device.choose_dtype", lambda device: torch.bfloat16)
    trainer = MegatronTrainer(megatron_cfg(), tmp_path)
    rows = [make_row([(6, 10), (4, 12)], [1.0, -1.0], seed=1)]
    (forward,) = build_micro_batch(rows, trainer.model.device, varlen_attention=False).forwards or []
    num_pieces, length = forward.input_ids.shape
    num_scores = num_pieces * trainer.model.shape.num_heads * length * length
    kept: dict[int, tuple[torch.dtype, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == num_scores:  # a [B, heads, L, L] tensor (or a view of one)
            storage = tensor.untyped_storage()
            kept[storage.data_ptr()] = (tensor.dtype, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.model.stage_output(forward)
    trainer.close()
    num_layers = trainer.model.shape.num_layers
    dtypes = [dtype for dtype, _ in kept.values()]
    assert dtypes.count(torch.float32) == dtypes.count(torch.bfloat16) == num_layers == len(dtypes) // 2
    assert sum(nbytes for _, nbytes in kept.values()) == num_layers * ATTENTION_SCORE_KEPT_BYTES * num_scores
