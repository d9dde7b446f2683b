"""One rank of the Megatron multi-rank tests (run by torchrun from test_megatron_ranks.py; not a test module).

Usage: torchrun --standalone --nproc_per_node N megatron_dist_worker.py MODEL_PATH OUT_DIR TP PP
Every rank builds a MegatronTrainer (float32, tensor parallel TP, pipeline stages PP, data parallel
N / (TP x PP)), rank 0 shares `batch()`; every rank scores its rows, trains one step and scores them again; rank 0
writes both logprobs, the metrics and the whole HF-named weights after the step to OUT_DIR (the
logprobs after it also read the last pipeline stage's copy of a tied embedding).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

from trainer_batches import make_row

from grpo.transport.batch import TrainingBatch


def batch() -> TrainingBatch:
    rows = [
        make_row([(6, 10), (4, 12)], [1.0, -1.0], seed=1, temperature=0.7),
        make_row([(9, 7)], [0.5], seed=2, temperature=1.3),
        make_row([(5, 9), (3, 6)], [-0.5, 2.0], seed=3),
        make_row([(4, 8)], [1.5], seed=4),
    ]
    for row in rows:
        row.inference_logprobs = np.where(row.loss_mask, -10.5, 0.0).astype(np.float32)
    return TrainingBatch(step=0, rows=rows)


def main(model_path: str, out_dir: Path, tp: int, pp: int) -> None:
    import os

    import torch
    from safetensors.torch import save_file

    import grpo.trainer.model as model_module
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.megatron.trainer import MegatronTrainer

    model_module.choose_dtype = lambda device: torch.float32  # type: ignore[assignment]
    cfg = TrainerConfig(
        model=model_path,
        backend="megatron",
        lora=False,
        gpus=int(os.environ.get("WORLD_SIZE", "1")),
        megatron={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        learning_rate=1e-3,
        adam_epsilon=1e-5,  # see test_megatron_step: keeps Adam's first update smooth in the gradient
        max_grad_norm=0.5,
        per_device_train_batch_size=1,
        logprob_chunk_size=16,
    )
    trainer = MegatronTrainer(cfg, out_dir / "run")
    shared = trainer.share_batch(batch() if trainer.is_main else None)
    assert shared is not None
    logprobs = trainer.score(shared.rows)
    metrics = trainer.train_step(shared)
    updated_logprobs = trainer.score(shared.rows)
    weights = trainer.hf_state_dict()
    if trainer.is_main:
        assert weights is not None
        tensors = {f"weight.{k}": v.float().contiguous() for k, v in weights.items()}
        tensors.update({f"logprobs.{i}": torch.from_numpy(lp) for i, lp in enumerate(logprobs)})
        tensors.update(
            {f"logprobs.updated.{i}": torch.from_numpy(lp) for i, lp in enumerate(updated_logprobs)}
        )
        save_file(tensors, str(out_dir / "result.safetensors"))
        (out_dir / "metrics.json").write_text(json.dumps(metrics))
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
