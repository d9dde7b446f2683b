"""Publish policy v to `{run_dir}/broadcasts/step_{v}/` for the inference side (docs/design.md): the
steps both backends share (each writes its own weights: grpo.trainer.hf.publish,
grpo.trainer.megatron.export).

LoRA: a PEFT adapter folder. Full: the HF model folder (safetensors, HF names). Built in a staging
folder and moved into place with STABLE written last; old versions are pruned so only the ones an
orchestrator may still sample from (max_async_level + 1 newest) stay on disk.

Full weights over a collective (`weight_broadcast.type: nccl`, see docs/multi_node.md): the
folder holds only an announcement (grpo.transport.weights.announce), then the trainer opens a
fresh session on weight_broadcast.host:port as rank 0, waits up to weight_broadcast.timeout for
its weight_broadcast.num_servers inference servers to join and prove the secret in
weight_broadcast.secret_env, broadcasts the state dict and closes the session. One session per
version: a restarted trainer or server never meets stale state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from grpo.transport.weights.filesystem import broadcast_dir
from grpo.utils.atomic import prune_stable, publish_dir, staging_dir

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import TrainerConfig


def send_over_collective(
    tensors: list[tuple[str, torch.Tensor]], cfg: TrainerConfig, run_dir: Path, version: int
) -> Path:
    """publish_over_collective for HF-named full weights from any backend."""
    from grpo.transport.weights.announce import write_collective_manifest
    from grpo.transport.weights.collective import CollectiveWeightSender

    wb = cfg.weight_broadcast
    assert wb.type == "nccl", "the collective path needs weight_broadcast type nccl"
    final = broadcast_dir(run_dir, version)
    staged = staging_dir(final)
    num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    write_collective_manifest(staged, version, wb.host, wb.port, len(tensors), num_bytes)
    publish_dir(staged, final)
    prune_stable(final.parent, keep=cfg.max_async_level + 1)
    sender = CollectiveWeightSender.for_config(wb)
    try:
        sender.send(version, tensors)
    finally:
        sender.close()
    return final
