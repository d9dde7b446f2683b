"""How much a micro-batch's activations take, and what the trainer does about it: the token budget
of a micro-batch (train.yaml `micro_batch_tokens`) and which decoder layers recompute their
activations in backward (`gradient_checkpointing: auto`). No torch import: the co-located memory
plan (grpo.colocate.memory_plan) sizes both before anything starts, and the HF trainer decides
auto's layers for each group of micro-batches (grpo.trainer.hf.checkpointing).

The estimates count tensors of max(hidden, intermediate) elements per token (measured: below) in
the trainer's compute dtype (ModelShape.activation_value_bytes: a float32 trainer's take twice a
bf16 one's).
The micro-batch budget is what fits ACTIVATION_SHARE of the memory planned against; the rest holds
weights, optimizer state and, co-located, vLLM's KV cache. The micro-batches of one accumulation
group keep their activations together until their backward (grpo.trainer.hf.trainer), so `auto`
decides per group from the group's own tokens, against activation_memory_gib: a co-located plan
reserves what its worst case needs (micro_batches_per_backward full micro-batches, at most a
step's tokens), and most steps, with shared prompts and short completions, hold far fewer tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.config.trainer import TrainerConfig
from grpo.models.shape import ModelShape

# Activations per decoder layer and token, in tensors of max(hidden, intermediate) elements of the
# compute dtype.
# Keeping every layer's: measured on an H100 (Qwen3-0.6B shape, LoRA rank 16, micro-batches of
# 8,192 tokens, no gradient checkpointing; benchmarks/trainer_bench.py) 20.9 GiB reserved at peak,
# about 13 such tensors per layer once weights, LoRA state and the logits chunk are taken off
# (RMSNorm's float32 copies, q/k/v/o, the MLP's four intermediate-sized tensors, LoRA's inputs, the
# caching allocator's slack); 14 counted. Recomputing 8 of 28 layers there peaked at 15.8 GiB, 0.64
# GiB per kept layer above recomputing all. Recomputing, one layer's working set at a time: 6 counted
# (recomputing every layer peaked at 3.6 GiB reserved against a 4.9 GiB plan).
ACTIVATION_TENSORS_PER_LAYER_KEPT = 14
ACTIVATION_TENSORS_ONE_LAYER = 6
ACTIVATION_SHARE = 0.5
"""Share of the memory planned against that the activations alive at once may take (when
activation_memory_gib is unset), and that sizes the micro-batch budget."""
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
    return num_tokens * max(shape.hidden_size, shape.intermediate_size) * shape.activation_value_bytes


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
    inputs = num_recomputed * num_tokens * shape.hidden_size * shape.activation_value_bytes
    return kept + inputs + ACTIVATION_TENSORS_ONE_LAYER * _tensor_bytes(shape, num_tokens)


def planned_micro_batch_tokens(train: TrainerConfig, shape: ModelShape, memory_bytes: int) -> int:
    """micro_batch_tokens where set; else the most tokens (a multiple of BUDGET_STEP, at most
    MAX_PLANNED_MICRO_BATCH_TOKENS) whose activations, every layer's kept, fit ACTIVATION_SHARE of
    `memory_bytes`, and never fewer than one sequence_len row."""
    if train.micro_batch_tokens is not None:
        return train.micro_batch_tokens
    floor = train.rows_per_micro_batch * train.sequence_len
    per_token = activation_bytes(shape, 1, 0)
    fitting = int(ACTIVATION_SHARE * memory_bytes) // per_token // BUDGET_STEP * BUDGET_STEP
    return max(floor, min(MAX_PLANNED_MICRO_BATCH_TOKENS, fitting))


def alive_tokens(train: TrainerConfig, micro_batch_tokens: int, max_step_tokens: int | None) -> int:
    """Most tokens whose activations are alive at once: an accumulation group of micro-batches, at
    most a step's tokens where known."""
    alive = train.micro_batches_per_backward * micro_batch_tokens
    return alive if max_step_tokens is None else min(alive, max_step_tokens)


def activation_budget_bytes(train: TrainerConfig, memory_bytes: int) -> int:
    """What an accumulation group's activations may take: activation_memory_gib, else
    ACTIVATION_SHARE of `memory_bytes`."""
    if train.activation_memory_gib is not None:
        return int(train.activation_memory_gib * 2**30)
    return int(ACTIVATION_SHARE * memory_bytes)


def checkpointing_choice(
    train: TrainerConfig, shape: ModelShape, num_tokens: int, budget_bytes: int, num_loss_tokens: int = 0
) -> CheckpointingChoice:
    """What `gradient_checkpointing` means when `num_tokens` tokens' activations are alive at once:
    auto recomputes as few layers as bring them within `budget_bytes` (every layer when even that
    does not), or a few more where that makes room to keep the `num_loss_tokens` loss tokens'
    probabilities and costs less (recompute_for_probabilities)."""
    setting = train.gradient_checkpointing
    num_layers = shape.num_layers
    if setting is True:
        return CheckpointingChoice(num_layers, "gradient_checkpointing: true")
    if setting is False:
        return CheckpointingChoice(0, "gradient_checkpointing: false")
    if setting != "auto":
        return CheckpointingChoice(min(int(setting), num_layers), f"gradient_checkpointing: {setting}")
    fewest = _fewest_recomputed(shape, num_tokens, budget_bytes)
    more = recompute_for_probabilities(shape, num_tokens, num_loss_tokens, budget_bytes, fewest.num_layers)
    if more is None:
        return fewest
    kept = f"keeping the {num_loss_tokens} loss tokens' probabilities for backward"
    if more == fewest.num_layers:
        return CheckpointingChoice(more, f"{fewest.reason}; {kept}")
    return CheckpointingChoice(
        more,
        f"{fewest.reason}; {more - fewest.num_layers} more layers recomputed make room for {kept}, "
        "which costs less than running the lm_head over them again",
    )


def recompute_for_probabilities(
    shape: ModelShape, num_tokens: int, num_loss_tokens: int, budget_bytes: int, num_recomputed: int
) -> int | None:
    """The layers to recompute so that the loss tokens' probabilities fit beside the activations,
    where that is at least `num_recomputed` and costs less than not keeping them; None otherwise.

    Not keeping them runs the lm_head over every loss token again in backward (grpo.trainer.logprobs
    recomputes each chunk's logits), 2 x hidden x vocab FLOPs a loss token; each further recomputed
    layer runs its linears' forward again over every token. With SmolLM2-135M's 49k vocabulary the
    lm_head costs as much as eight layers: on 2 CPU cores (float32) a long-brief-shaped step (1,790
    tokens, 1,280 of them loss tokens) took 13.41 s recomputing 9 layers and keeping them, 13.94 s
    recomputing 8 and running the lm_head again (benchmarks/README, "Seconds per step at the same
    precision")."""
    if num_loss_tokens == 0:
        return None
    lm_head_flops = 2 * shape.hidden_size * shape.vocab_size * num_loss_tokens
    layer_flops = 2 * shape.num_linear_params() // shape.num_layers * num_tokens
    for count in range(num_recomputed, shape.num_layers + 1):
        if (count - num_recomputed) * layer_flops >= lm_head_flops:
            return None
        if keeps_probabilities(shape, num_tokens, num_loss_tokens, count, budget_bytes):
            return count
    return None


def _fewest_recomputed(shape: ModelShape, num_tokens: int, budget_bytes: int) -> CheckpointingChoice:
    """auto's fewest layers recomputed that bring `num_tokens` tokens' activations within `budget_bytes`."""
    num_layers = shape.num_layers
    room = f"the {budget_bytes / 2**30:.2f} GiB for activations"
    every = activation_bytes(shape, num_tokens, 0)
    if every <= budget_bytes:
        return CheckpointingChoice(
            0, f"{num_tokens} tokens alive at once keep {every / 2**30:.2f} GiB, within {room}"
        )
    for count in range(1, num_layers + 1):
        needed = activation_bytes(shape, num_tokens, count)
        if needed <= budget_bytes:
            return CheckpointingChoice(
                count,
                f"{num_tokens} tokens alive at once would keep {every / 2**30:.2f} GiB, above {room}; "
                f"recomputing {count} layers brings them to {needed / 2**30:.2f} GiB",
            )
    needed = activation_bytes(shape, num_tokens, num_layers)
    return CheckpointingChoice(
        num_layers,
        f"{num_tokens} tokens alive at once keep {needed / 2**30:.2f} GiB even recomputing every layer, above {room}",
    )


def keeps_probabilities(
    shape: ModelShape, num_tokens: int, num_loss_tokens: int, num_recomputed: int, budget_bytes: int
) -> bool:
    """Whether a group of micro-batches keeps its loss tokens' float32 probabilities [tokens, vocab]
    from forward to backward (grpo.trainer.fused_logprobs) rather than recomputing the logits: where
    its activations, `num_recomputed` layers recomputing, and the probabilities together fit
    `budget_bytes` (auto recomputes more layers to make that room where it pays:
    recompute_for_probabilities)."""
    probabilities = num_loss_tokens * shape.vocab_size * 4
    return activation_bytes(shape, num_tokens, num_recomputed) + probabilities <= budget_bytes


def tokens_without_recompute(shape: ModelShape, budget_bytes: int) -> int:
    """Most tokens alive at once whose activations fit `budget_bytes` with every layer's kept."""
    return budget_bytes // activation_bytes(shape, 1, 0)


def resolved_for_memory(
    train: TrainerConfig, shape: ModelShape, memory_bytes: int, max_step_tokens: int | None = None
) -> tuple[TrainerConfig, CheckpointingChoice]:
    """`train` with micro_batch_tokens set for `memory_bytes` (the memory plan's) and, under auto,
    activation_memory_gib: what the worst case (the most tokens alive at once) needs with the
    fewest layers recomputed that fit ACTIVATION_SHARE; and the choice for that worst case."""
    tokens = planned_micro_batch_tokens(train, shape, memory_bytes)
    train = train.model_copy(update={"micro_batch_tokens": tokens})
    worst = alive_tokens(train, tokens, max_step_tokens)
    choice = checkpointing_choice(train, shape, worst, activation_budget_bytes(train, memory_bytes))
    if train.gradient_checkpointing == "auto" and train.activation_memory_gib is None:
        reserved = activation_bytes(shape, worst, choice.num_layers)
        train = train.model_copy(update={"activation_memory_gib": reserved / 2**30})
    return train, choice


def num_recomputed_layers(train: TrainerConfig, num_layers: int) -> int:
    """Layers an explicit `gradient_checkpointing` recomputes; auto counts as every layer (the least
    memory: the trainer decides per accumulation group)."""
    setting = train.gradient_checkpointing
    if setting == "auto" or setting is True:
        return num_layers
    if setting is False:
        return 0
    return min(int(setting), num_layers)
