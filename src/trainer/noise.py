"""QeRL noise: Gaussian noise on the inference copy of the RMSNorm weights, decaying over training.

The trainer never trains on noisy weights; it publishes noisy copies of the norms next to each
adapter or full-weight policy (grpo.transport.weights.filesystem.NOISY_NORMS_FILE; the Megatron
backend draws them once, on rank 0, from the gathered HF-named weights), and the orchestrator has the servers
apply them after loading that policy (grpo.orchestrator.scheduler.PolicyTracker.load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn

    from grpo.config.trainer import NoiseSchedulerConfig, TrainerConfig


def noise_sigma(cfg: NoiseSchedulerConfig, step: int, max_steps: int) -> float:
    """Sigma for rollouts of `step`: max_steps is cut into num_stages equal intervals; the first has
    no noise, the others decay geometrically from sigma_start (second interval) to sigma_end (last)."""
    if not cfg.enabled:
        return 0.0
    if max_steps <= 0:
        raise UserError(
            "noise_scheduler needs max_steps > 0 to lay out its stages; set max_steps in train.yaml"
        )
    stage = min(step * cfg.num_stages // max_steps, cfg.num_stages - 1)
    if stage == 0:
        return 0.0
    num_noisy_stages = cfg.num_stages - 1
    if num_noisy_stages == 1:
        return cfg.sigma_start
    fraction = (stage - 1) / (num_noisy_stages - 1)
    return float(cfg.sigma_start * (cfg.sigma_end / cfg.sigma_start) ** fraction)


def rms_norm_weights(causal_lm: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> weight of every RMSNorm module (input_layernorm, post_attention_layernorm, norm, ...)."""
    found = {}
    for name, module in causal_lm.named_modules():
        weight = getattr(module, "weight", None)
        if type(module).__name__.endswith("RMSNorm") and weight is not None:
            found[f"{name}.weight"] = weight
    return found


def noisy_norms(causal_lm: nn.Module, sigma: float, seed: int) -> dict[str, torch.Tensor]:
    """Noisy copies (float32, CPU) of the RMSNorm weights: w + N(0, sigma^2)."""
    return noisy_copies(rms_norm_weights(causal_lm), sigma, seed)


def noisy_copies(norms: dict[str, torch.Tensor], sigma: float, seed: int) -> dict[str, torch.Tensor]:
    """w + N(0, sigma^2) (float32, CPU) for each HF-named norm weight, drawn in name order from one
    generator seeded `seed`: the same weights, sigma and seed give the same noise in every backend
    and on every rank."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, weight in sorted(norms.items()):
        clean = weight.detach().float().cpu()
        out[name] = (clean + sigma * torch.randn(clean.shape, generator=generator)).contiguous()
    return out


def write_noisy_norms(norms: dict[str, torch.Tensor], cfg: TrainerConfig, version: int, folder: Path) -> None:
    """Policy `version`'s noisy norms (sigma from cfg.noise_scheduler, seed cfg.seed + version) into
    `folder` (grpo.transport.weights.filesystem.NOISY_NORMS_FILE), for the orchestrator to apply."""
    from safetensors.torch import save_file

    from grpo.transport.weights.filesystem import NOISY_NORMS_FILE

    sigma = noise_sigma(cfg.noise_scheduler, version, cfg.max_steps)
    tensors = noisy_copies(norms, sigma, seed=cfg.seed + version)
    save_file(tensors, str(folder / NOISY_NORMS_FILE), metadata={"sigma": repr(sigma)})
