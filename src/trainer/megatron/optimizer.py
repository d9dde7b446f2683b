"""Megatron's DDP wrapper and optimizer for the Megatron backend, and the learning-rate schedule.

DDP keeps each parameter's gradient in a contiguous buffer (`main_grad`, fp32 with
`grad_reduce_in_fp32`) and reduces it over the data-parallel ranks; with calculate_per_token_loss
(set in grpo.trainer.megatron.model) it sums rather than averages, since every rank's loss is
already divided by the whole step's loss tokens. The optimizer is Adam with decoupled weight
decay; with `use_distributed_optimizer` the fp32 main weights and moments are sharded over the
data-parallel ranks. Every weight decays, biases and norms included, as with the HF backend's
AdamW: megatron-core marks biases and norms wd_mult 0, but only its OptimizerParamScheduler applies
that, and the schedule here is ours (set_learning_rate).

The learning rate of each step comes from grpo.trainer.optim.lr_multiplier, the HF backend's
schedule, written into the optimizer's parameter groups before the step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.megatron.model import MegatronModel


def build_ddp_and_optimizer(cfg: TrainerConfig, model: MegatronModel) -> tuple[Any, Any]:
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from grpo.trainer.megatron.cpu_compat import on_cpu
    from grpo.utils.logging import get_logger

    mp = cfg.megatron
    if cfg.optimizer == "adamw_8bit":
        get_logger("trainer").info(
            "backend megatron uses Megatron's Adam (fp32 moments); optimizer adamw_8bit is ignored"
        )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=mp.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=mp.use_distributed_optimizer,
    )
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_epsilon,
        bf16=model.dtype == torch.bfloat16,
        params_dtype=model.dtype,
        use_distributed_optimizer=mp.use_distributed_optimizer,
        clip_grad=cfg.max_grad_norm,
    )
    with on_cpu():
        ddp = DistributedDataParallel(config=model.module.config, ddp_config=ddp_config, module=model.module)
        optimizer = get_megatron_optimizer(optimizer_config, [ddp])
    return ddp, optimizer


def set_learning_rate(cfg: TrainerConfig, optimizer: Any, step: int) -> float:
    """Set the learning rate of optimizer step `step` (0-based); returns it."""
    from grpo.trainer.optim import lr_multiplier

    lr = cfg.learning_rate * lr_multiplier(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
