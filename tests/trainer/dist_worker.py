"""One rank of the data-parallel test (run by torchrun from test_distributed.py; not a test module).

Usage: torchrun --standalone --nproc_per_node N dist_worker.py MODEL_PATH OUT_DIR lora|full
Rank 0 alone builds the batch and shares it; every rank checks what it received, trains one step,
and rank 0 writes the trainable parameters and their gradients to OUT_DIR/rank0.safetensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from trainer_batches import distributed_test_batch, distributed_test_cfg

from grpo.trainer.trainer import Trainer


def _full(tensor):
    """The whole tensor on every rank (FSDP2 parameters are sharded DTensors; a collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def main() -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    model_path, out_dir, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    trainer = Trainer(distributed_test_cfg(model_path, lora=mode == "lora"), out_dir / "run")
    assert trainer.dist is not None, "run me under torchrun with more than one process"
    expected = distributed_test_batch()
    batch = trainer.share_batch(expected if trainer.is_main else None)
    assert batch is not None and batch.step == expected.step and len(batch.rows) == len(expected.rows)
    for got, want in zip(batch.rows, expected.rows, strict=True):
        for name in ("input_ids", "position_ids", "loss_mask", "advantages", "temperatures"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
    metrics = trainer.train_step(batch)
    assert trainer.share_batch(None) is None  # the stop message reaches every rank
    tensors: dict[str, torch.Tensor] = {}
    for name, param in trainer.policy.model.named_parameters():
        if param.requires_grad:
            tensors[f"param.{name}"] = _full(param.detach()).float().contiguous()
            tensors[f"grad.{name}"] = _full(param.grad.detach()).float().contiguous()
    if trainer.is_main:
        tensors["metrics.tokens"] = torch.tensor([metrics["tokens"]])
        tensors["metrics.loss"] = torch.tensor([metrics["loss"]])
        save_file(tensors, str(out_dir / "rank0.safetensors"))
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
