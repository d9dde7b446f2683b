"""Publish the HF backend's policy v: a PEFT adapter folder (LoRA) or the HF model folder (full
weights) in `{run_dir}/broadcasts/step_{v}/`, or full weights over the weight collective (the
shared steps and their rules: grpo.trainer.publish).

Under FSDP2, Trainer.publish hands these functions an unsharded copy of the model on rank 0
(grpo.trainer.hf.fsdp.whole_model_copy): one code path for sharded and unsharded policies.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from grpo.trainer.publish import send_over_collective
from grpo.transport.weights.filesystem import broadcast_dir
from grpo.utils.atomic import prune_stable, publish_dir, staging_dir

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.model import Policy


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


def publish_policy(policy: Policy, cfg: TrainerConfig, run_dir: Path, version: int) -> Path:
    """Write policy `version` to broadcasts/step_{version}/ (STABLE last) and prune older ones."""
    from grpo.trainer.noise import rms_norm_weights, write_noisy_norms

    final = broadcast_dir(run_dir, version)
    staged = staging_dir(final)
    write_weights(policy, staged)
    if cfg.noise_scheduler.enabled:
        write_noisy_norms(rms_norm_weights(policy.causal_lm), cfg, version, staged)
    publish_dir(staged, final)
    prune_stable(final.parent, keep=cfg.max_async_level + 1)
    return final
