"""What backend megatron's attention keeps for backward per score, pinned against megatron-core's
own local DotProductAttention (the memory plan's `attention scores` row counts it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

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


@pytest.mark.gpu
def test_a_step_on_cuda_holds_the_attention_scores_the_memory_plan_counts(
    megatron_cfg: Callable[..., TrainerConfig],
    tiny_model_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainer_batches import on_policy_batch

    from grpo.colocate.memory_plan import trainer_rows
    from grpo.models.shape import ModelShape
    from grpo.trainer.megatron import layer_spec
    from grpo.trainer.megatron.trainer import MegatronTrainer

    # megatron-core's local attention (TE's fused softmax kernel keeps less: the plan is its bound).
    monkeypatch.setattr(layer_spec, "use_transformer_engine", lambda device: False)
    cfg = megatron_cfg(device="cuda", sequence_len=2048)
    trainer = MegatronTrainer(cfg, tmp_path)
    rows = [make_row([(48, 2000)], [1.0], seed=3)]  # one 2048-token piece: 2 heads x 2048^2 scores
    trainer.train_step(on_policy_batch(trainer, 0, rows))  # Adam's moments and the score buffer exist after
    batch = on_policy_batch(trainer, 1, rows)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    metrics = trainer.train_step(batch)
    # the step's own row reads the peak (and starts it over for the next step: grpo.trainer.step_report)
    peak = metrics["memory/peak_allocated_gib"] * 2**30 - before
    trainer.close()
    plan = {name: size for name, size, _ in trainer_rows(cfg, ModelShape.from_folder(tiny_model_path), True)}
    num_scores = 2 * 2048 * 2048
    assert peak >= 0.95 * 2 * ATTENTION_SCORE_KEPT_BYTES * num_scores  # both layers' scores were kept
    assert peak <= plan["activations"] + plan["attention scores"]
