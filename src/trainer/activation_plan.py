"""How much a micro-batch's activations take, and what the trainer does about it: the token budget
of a micro-batch (train.yaml `micro_batch_tokens`) and which decoder layers recompute their
activations in backward (`gradient_checkpointing: auto`). No torch import: the co-located memory
plan (grpo.colocate.memory_plan) uses it before anything starts, and the HF trainer uses it at
start when no plan resolved these settings (grpo-train alone).

The estimates count bf16 tensors of max(hidden, intermediate) elements per token (the measurements
behind the two counts are in grpo.colocate.memory_plan). A micro-batch's activations may take
ACTIVATION_SHARE of the memory planned against: the rest holds weights, optimizer state and, in a
co-located run, vLLM's KV cache. The micro-batches of one accumulation group keep their activations
together until their backward (grpo.trainer.hf.trainer), so the checkpointing choice counts
gradient_accumulation_steps of them, or a step's tokens where the plan knows fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.trainer import TrainerConfig
from grpo.models.shape import ModelShape

# Activations per decoder layer and token, in bf16 tensors of max(hidden, intermediate) elements.
# Keeping every layer's: measured on an H200 (Qwen3-0.6B shape, LoRA rank 16, 8 x 2048 tokens, no
# gradient checkpointing) 32.1 GiB reserved at peak, about 11 such tensors per layer (RMSNorm's
# float32 copies, q/k/v/o, the MLP's four intermediate-sized tensors, LoRA's inputs); 12 counted.
# Recomputing, one layer's working set at a time: 6 counted (the same run with checkpointing
# peaked at 5.49 GiB reserved against a 5.63 GiB plan).
ACTIVATION_TENSORS_PER_LAYER_KEPT = 12
ACTIVATION_TENSORS_ONE_LAYER = 6
ACTIVATION_SHARE = 0.5
"""Share of the planned memory the activations alive at once (gradient_accumulation_steps
micro-batches' worth, at most a step's) may take before layers recompute."""
MAX_PLANNED_MICRO_BATCH_TOKENS = 8192
"""Ceiling of a planned micro-batch budget: enough for a group's prefix tree of a long prompt and
16 x 256-token completions; past it a bigger budget saves no prompt encodings, only memory."""
BUDGET_STEP = 256


@dataclass(frozen=True)
class CheckpointingChoice:
    num_layers: int
    """Decoder layers that recompute their activations in backward (the first ones)."""

    reason: str
    """Why, for `grpo --dry-run` and the trainer's log."""

    def describe(self, num_layers_total: int) -> str:
        if self.num_layers == 0:
            which = "off"
        elif self.num_layers >= num_layers_total:
            which = f"on, all {num_layers_total} layers"
        else:
            which = f"on, the first {self.num_layers} of {num_layers_total} layers"
        return f"gradient checkpointing {which}: {self.reason}"


def _tensor_bytes(shape: ModelShape, num_tokens: int) -> int:
    return num_tokens * max(shape.hidden_size, shape.intermediate_size) * 2


def activation_bytes(shape: ModelShape, num_tokens: int, num_recomputed: int) -> int:
    """A micro-batch's decoder activations with `num_recomputed` layers recomputing: a kept layer
    holds its own tensors until backward reaches it; a recomputed one only its input, plus one
    layer's working set while it is recomputed."""
    num_recomputed = min(num_recomputed, shape.num_layers)
    kept = (
        (shape.num_layers - num_recomputed)
        * ACTIVATION_TENSORS_PER_LAYER_KEPT
        * _tensor_bytes(shape, num_tokens)
    )
    if num_recomputed == 0:
        return kept
    inputs = num_recomputed * num_tokens * shape.hidden_size * 2
    return kept + inputs + ACTIVATION_TENSORS_ONE_LAYER * _tensor_bytes(shape, num_tokens)


def planned_micro_batch_tokens(train: TrainerConfig, shape: ModelShape, memory_bytes: int) -> int:
    """micro_batch_tokens where set; else the most tokens (a multiple of BUDGET_STEP, at most
    MAX_PLANNED_MICRO_BATCH_TOKENS) whose activations, every layer's kept, fit ACTIVATION_SHARE of
    `memory_bytes`, and never fewer than per_device_train_batch_size x sequence_len."""
    if train.micro_batch_tokens is not None:
        return train.micro_batch_tokens
    floor = train.per_device_train_batch_size * train.sequence_len
    per_token = activation_bytes(shape, 1, 0)
    fitting = int(ACTIVATION_SHARE * memory_bytes) // per_token // BUDGET_STEP * BUDGET_STEP
    return max(floor, min(MAX_PLANNED_MICRO_BATCH_TOKENS, fitting))


def alive_tokens(train: TrainerConfig, micro_batch_tokens: int, max_step_tokens: int | None) -> int:
    """Tokens whose activations are alive at once: an accumulation group of micro-batches, at most a
    step's tokens where known."""
    alive = train.gradient_accumulation_steps * micro_batch_tokens
    return alive if max_step_tokens is None else max(micro_batch_tokens, min(alive, max_step_tokens))


def checkpointing_choice(
    train: TrainerConfig, shape: ModelShape, num_tokens: int, memory_bytes: int
) -> CheckpointingChoice:
    """What `gradient_checkpointing` means when `num_tokens` tokens' activations are alive at once
    (`alive_tokens`): auto recomputes as few layers as bring them within ACTIVATION_SHARE of
    `memory_bytes` (every layer when even that does not)."""
    setting = train.gradient_checkpointing
    num_layers = shape.num_layers
    if setting is True:
        return CheckpointingChoice(num_layers, "gradient_checkpointing: true")
    if setting is False:
        return CheckpointingChoice(0, "gradient_checkpointing: false")
    if setting != "auto":
        return CheckpointingChoice(min(int(setting), num_layers), f"gradient_checkpointing: {setting}")
    budget = int(ACTIVATION_SHARE * memory_bytes)
    room = f"{ACTIVATION_SHARE:.0%} of {memory_bytes / 2**30:.1f} GiB = {budget / 2**30:.2f} GiB"
    every = activation_bytes(shape, num_tokens, 0)
    if every <= budget:
        return CheckpointingChoice(
            0, f"{num_tokens} tokens' activations alive at once, {every / 2**30:.2f} GiB, are within {room}"
        )
    for count in range(1, num_layers + 1):
        needed = activation_bytes(shape, num_tokens, count)
        if needed <= budget:
            return CheckpointingChoice(
                count,
                f"{num_tokens} tokens' activations alive at once, {every / 2**30:.2f} GiB, exceed {room}; "
                f"recomputing {count} brings them to {needed / 2**30:.2f} GiB",
            )
    needed = activation_bytes(shape, num_tokens, num_layers)
    return CheckpointingChoice(
        num_layers,
        f"{num_tokens} tokens' activations alive at once take {needed / 2**30:.2f} GiB even recomputing "
        f"every layer, above {room}",
    )


def planned_choices(
    train: TrainerConfig, shape: ModelShape, memory_bytes: int, max_step_tokens: int | None
) -> tuple[int, CheckpointingChoice]:
    """The micro-batch budget and the checkpointing choice for `memory_bytes` (the memory plan's, or
    the trainer's device's); `max_step_tokens`: most tokens a step can hold, where known."""
    tokens = planned_micro_batch_tokens(train, shape, memory_bytes)
    alive = alive_tokens(train, tokens, max_step_tokens)
    return tokens, checkpointing_choice(train, shape, alive, memory_bytes)


def resolved_for_memory(
    train: TrainerConfig, shape: ModelShape, memory_bytes: int, max_step_tokens: int | None = None
) -> TrainerConfig:
    """`train` with micro_batch_tokens and gradient_checkpointing (auto: the number of layers) set as
    `planned_choices` chooses them."""
    tokens, choice = planned_choices(train, shape, memory_bytes, max_step_tokens)
    setting = train.gradient_checkpointing
    resolved = choice.num_layers if setting == "auto" else setting
    return train.model_copy(update={"micro_batch_tokens": tokens, "gradient_checkpointing": resolved})


def num_recomputed_layers(train: TrainerConfig, num_layers: int) -> int:
    """Layers a resolved `gradient_checkpointing` recomputes; auto left unresolved counts as every
    layer (the least memory; the plan and the trainer resolve it first)."""
    setting = train.gradient_checkpointing
    if setting == "auto" or setting is True:
        return num_layers
    if setting is False:
        return 0
    return min(int(setting), num_layers)
