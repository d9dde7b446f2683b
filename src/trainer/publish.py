"""Publish policy v to `{run_dir}/broadcasts/step_{v}/` for the inference side (docs/design.md).

LoRA: a PEFT adapter folder. Full: the HF model folder (safetensors, HF names). Built in a staging
folder and moved into place with STABLE written last; old versions are pruned so only the ones an
orchestrator may still sample from (max_async_level + 1 newest) stay on disk.

Full weights over a collective (`weight_broadcast.type: nccl`, see docs/multi_node.md): the
folder holds only an announcement (grpo.transport.weights_announce), then the trainer opens a
fresh session on weight_broadcast.host:port as rank 0, waits up to weight_broadcast.timeout for
its weight_broadcast.num_servers inference servers to join and prove the secret in
weight_broadcast.secret_env, broadcasts the state dict and closes the session. One session per
version: a restarted trainer or server never meets stale state.

Under FSDP2, Trainer.publish hands these functions an unsharded copy of the model on rank 0
(grpo.trainer.distributed.whole_model_copy): one code path for sharded and unsharded policies.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.transport.weights_filesystem import broadcast_dir
from grpo.utils.atomic import publish_dir, staging_dir, step_dirs

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.model import Policy


def write_weights(policy: Policy, folder: Path) -> None:
    """The adapter (LoRA) or full HF weights of `policy` into `folder`."""
    if policy.is_lora:
        policy.model.save_pretrained(folder)
    else:
        policy.causal_lm.save_pretrained(folder, safe_serialization=True)


def full_state_dict(policy: Policy) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of the full model; a tied alias (lm_head.weight when it is the embeddings)
    is left out, the receiver's load_weights re-ties it."""
    aliases = _tied_aliases(policy.causal_lm)
    return [(name, tensor) for name, tensor in policy.causal_lm.state_dict().items() if name not in aliases]


def _tied_aliases(module: torch.nn.Module) -> set[str]:
    """Names of parameters that are another, earlier-named parameter (by identity: a state dict
    lists a tied tensor under both names)."""
    seen: set[int] = set()
    aliases = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def publish_over_collective(policy: Policy, cfg: TrainerConfig, run_dir: Path, version: int) -> Path:
    """Announce `version` in broadcasts/step_{version}/ (STABLE last), then send it to the
    weight_broadcast.num_servers inference workers the orchestrator sends to
    weight_broadcast.host:port, over a fresh collective session. Blocks until all received it;
    TimeoutError naming the missing ranks after weight_broadcast.timeout, UserError naming a rank
    that does not prove the secret."""
    assert not policy.is_lora, "the collective path carries full weights only"
    return send_over_collective(full_state_dict(policy), cfg, run_dir, version)


def send_over_collective(
    tensors: list[tuple[str, torch.Tensor]], cfg: TrainerConfig, run_dir: Path, version: int
) -> Path:
    """publish_over_collective for HF-named full weights from any backend."""
    from grpo.transport.weights_announce import write_collective_manifest
    from grpo.transport.weights_collective import CollectiveWeightSender

    wb = cfg.weight_broadcast
    assert wb.type == "nccl", "the collective path needs weight_broadcast type nccl"
    final = broadcast_dir(run_dir, version)
    staged = staging_dir(final)
    num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
    write_collective_manifest(staged, version, wb.host, wb.port, len(tensors), num_bytes)
    publish_dir(staged, final)
    prune_step_dirs(final.parent, keep=cfg.max_async_level + 1)
    sender = CollectiveWeightSender(
        wb.host, wb.port, wb.timeout, num_servers=wb.num_servers, secret_env=wb.secret_env
    )
    try:
        sender.send(version, tensors)
    finally:
        sender.close()
    return final


def publish_policy(policy: Policy, cfg: TrainerConfig, run_dir: Path, version: int) -> Path:
    """Write policy `version` to broadcasts/step_{version}/ (STABLE last) and prune older ones."""
    from grpo.trainer.noise import rms_norm_weights, write_noisy_norms

    final = broadcast_dir(run_dir, version)
    staged = staging_dir(final)
    write_weights(policy, staged)
    if cfg.noise_scheduler.enabled:
        write_noisy_norms(rms_norm_weights(policy.causal_lm), cfg, version, staged)
    publish_dir(staged, final)
    prune_step_dirs(final.parent, keep=cfg.max_async_level + 1)
    return final


def prune_step_dirs(parent: Path, keep: int) -> None:
    """Delete all but the `keep` newest `step_{n}` folders of `parent`."""
    for path in list(step_dirs(parent).values())[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
