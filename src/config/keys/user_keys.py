"""The keys most runs set, grouped as a user meets them: what `grpo config show` prints by default
(`--all` prints every key). Each key's type, default and doc come from the config models
(grpo.config.keys.field_table); this table only picks and orders them."""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.across_files.shared_facts import File


@dataclass(frozen=True)
class KeyGroup:
    title: str
    file: File | None
    """The file that holds the keys; None for the shared keys (the top of rl.yaml, train.yaml names)."""

    keys: tuple[str, ...]


SHARED_KEYS = ("model", "output_dir", "max_steps", "max_seq_len", "seed", "lora_rank", "lora_alpha")
"""Shared facts (grpo.config.across_files.shared_facts) by their rl.yaml name, in the order a user sets them."""

USER_KEYS: tuple[KeyGroup, ...] = (
    KeyGroup("Shared keys: the top of rl.yaml; set in one file, they reach the others", None, SHARED_KEYS),
    KeyGroup(
        "Sizes",
        "orch",
        ("batch_size", "rollouts_per_example", "sampling.max_tokens", "micro_batch_tokens"),
    ),
    KeyGroup(
        "Model and optimizer",
        "train",
        (
            "lora",
            "lora_target_modules",
            "qlora_bnb",
            "learning_rate",
            "lr_scheduler_type",
            "warmup_steps",
            "max_grad_norm",
            "backend",
            "gpus",
            "gradient_checkpointing",
        ),
    ),
    KeyGroup(
        "Environments: each env[] item is an id block or a dataset block",
        "orch",
        (
            "env[].id",
            "env[].args",
            "env[].dataset",
            "env[].reward_funcs",
            "env[].prompt_column",
            "env[].system_prompt",
            "env[].num_examples",
            "env[].tools",
            "env[].judge",
            "env[].reward_model",
        ),
    ),
    KeyGroup(
        "Sampling", "orch", ("sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.stop")
    ),
    KeyGroup(
        "Loss",
        "train",
        ("loss.kl_beta", "loss.ratio_type", "loss.clip_low", "loss.clip_high", "loss.normalization"),
    ),
    KeyGroup("Advantage", "orch", ("advantage.type",)),
    KeyGroup(
        "Inference engine",
        "infer",
        ("gpu_memory_utilization", "dtype", "enforce_eager", "tp", "dp", "port"),
    ),
    KeyGroup("Evaluation", "orch", ("eval.env", "eval.interval", "eval.num_examples")),
    KeyGroup("Checkpoints", "train", ("ckpt.interval", "ckpt.resume_step", "ckpt.keep_last")),
    KeyGroup("Logs", "orch", ("report_to", "rollout_log.enabled")),
)
"""In print order."""
