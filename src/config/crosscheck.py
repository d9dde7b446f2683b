"""Checks across the three config files of one run.

Each file can be valid on its own and the run still be broken: a trainer waiting forever for a
batch written to another folder, an adapter rank the server cannot load. These checks catch such
combinations at load time, before anything starts.
"""

from __future__ import annotations

from pathlib import Path

from grpo.config.errors import ConfigError
from grpo.config.fp8_support import fp8_problems
from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.streaming import streaming_trainer_problem
from grpo.config.trainer import TrainerConfig


def run_dir_matches(trainer_output_dir: str, orch_output_dir: str) -> bool:
    """The trainer's output_dir is the run dir itself or its parent (docs/design.md)."""
    train = Path(trainer_output_dir).expanduser().resolve()
    orch = Path(orch_output_dir).expanduser().resolve()
    return orch == train or orch.parent == train


def fill_orchestrator_model(orch: OrchestratorConfig, model: str) -> OrchestratorConfig:
    """`orch.model.name` defaults to the trainer's model."""
    if orch.model.name is None:
        return orch.model_copy(update={"model": orch.model.model_copy(update={"name": model})})
    return orch


def loss_normalization_problem(
    advantage_type: str, train: TrainerConfig, batch_size: int, max_tokens: int | None
) -> str | None:
    """Dr. GRPO is its advantage and a constant loss normaliser; the latter lives in train.yaml."""
    if advantage_type != "dr_grpo" or train.loss.normalization == "constant":
        return None
    constant = "batch_size x sampling.max_tokens" if max_tokens is None else str(batch_size * max_tokens)
    return (
        "orch advantage.type dr_grpo divides the loss by a constant, not by the step's loss tokens; set train "
        f"loss.normalization: constant and loss.normalization_constant: {constant}"
    )


def check_trainer_orchestrator(train: TrainerConfig, orch: OrchestratorConfig, colocated: bool) -> list[str]:
    problems = []
    normalization = loss_normalization_problem(
        orch.advantage.type, train, orch.batch_size, orch.sampling.max_tokens
    )
    if normalization is not None:
        problems.append(normalization)
    if orch.model.name is not None and orch.model.name != train.model:
        problems.append(
            f"orch model.name '{orch.model.name}' differs from train model '{train.model}'; use the same model in both"
        )
    if train.lora:
        if orch.model.lora_adapter is None:
            problems.append("train lora is true but orch model.lora_adapter is null; set it (e.g. 'default')")
        if orch.model.lora_rank is not None and orch.model.lora_rank != train.lora_rank:
            problems.append(
                f"orch model.lora_rank ({orch.model.lora_rank}) differs from train lora_rank ({train.lora_rank})"
            )
        if orch.model.lora_alpha is not None and orch.model.lora_alpha != train.lora_alpha:
            problems.append(
                f"orch model.lora_alpha ({orch.model.lora_alpha}) differs from train lora_alpha ({train.lora_alpha})"
            )
    elif orch.model.lora_adapter is not None:
        problems.append(
            "train lora is false (full fine-tuning) but orch model.lora_adapter is set; set it to null"
        )
    if train.max_async_level != orch.max_async_level:
        problems.append(
            f"max_async_level differs: train {train.max_async_level}, orch {orch.max_async_level}; set the same value"
        )
    if orch.seq_len > train.sequence_len:
        problems.append(
            f"orch seq_len ({orch.seq_len}) exceeds train sequence_len ({train.sequence_len}); "
            "packed rows would not fit the trainer"
        )
    if train.max_steps != -1 and orch.max_steps is not None and train.max_steps != orch.max_steps:
        problems.append(f"max_steps differs: train {train.max_steps}, orch {orch.max_steps}")
    if not run_dir_matches(train.output_dir, orch.output_dir):
        problems.append(
            f"train output_dir '{train.output_dir}' is neither orch output_dir '{orch.output_dir}' nor its parent; "
            "the trainer would wait for batches in the wrong folder"
        )
    streaming = streaming_trainer_problem(orch.streaming.groups_per_part, train.gpus)
    if streaming is not None:
        problems.append(streaming)
    if train.loss.teacher_tau > 0 and orch.teacher_model is None:
        problems.append(
            "train loss.teacher_tau > 0 needs orch teacher_model (the teacher's logprobs come from it)"
        )
    if not colocated:
        if train.transport_type != orch.rollout_transport.type:
            problems.append(
                f"batch transport differs: train transport_type '{train.transport_type}', "
                f"orch rollout_transport.type '{orch.rollout_transport.type}'"
            )
        if train.weight_broadcast.type != orch.weight_broadcast.type:
            problems.append(
                f"weight broadcast differs: train weight_broadcast.type '{train.weight_broadcast.type}', "
                f"orch weight_broadcast.type '{orch.weight_broadcast.type}'"
            )
    return problems


def check_inference(
    infer: InferenceConfig, train: TrainerConfig | None, orch: OrchestratorConfig
) -> list[str]:
    problems = []
    model = orch.model.name
    if model is not None and infer.model != model:
        problems.append(f"infer model '{infer.model}' differs from orch model.name '{model}'")
    if orch.model.lora_adapter is not None and not infer.enable_lora:
        problems.append("orch serves a LoRA adapter but infer enable_lora is false; set enable_lora: true")
    rank = train.lora_rank if train is not None and train.lora else orch.model.lora_rank
    if infer.enable_lora and rank is not None and infer.served_lora_rank < rank:
        problems.append(
            f"infer max_lora_rank ({infer.max_lora_rank}) is below the LoRA rank ({rank}); set max_lora_rank >= {rank}"
        )
    if infer.weight_broadcast_type != orch.weight_broadcast.type:
        problems.append(
            f"infer weight_broadcast_type '{infer.weight_broadcast_type}' differs from orch weight_broadcast.type "
            f"'{orch.weight_broadcast.type}'"
        )
    max_tokens = orch.sampling.max_tokens
    if infer.max_model_len is not None and max_tokens is not None and max_tokens >= infer.max_model_len:
        problems.append(
            f"orch sampling.max_tokens ({max_tokens}) leaves no room for the prompt in infer max_model_len "
            f"({infer.max_model_len}); raise max_model_len or lower max_tokens"
        )
    if orch.sampling.max_tokens is not None and orch.sampling.max_tokens >= orch.seq_len:
        problems.append(
            f"orch sampling.max_tokens ({orch.sampling.max_tokens}) leaves no room for the prompt in "
            f"seq_len ({orch.seq_len})"
        )
    return problems


BORROWABLE_QUANTIZATIONS = frozenset({"fp8", "fp8_per_block"})
"""vLLM quantization methods whose weight layout grpo.colocate knows (FP8 data + scales)."""


def check_colocated(
    train: TrainerConfig, infer: InferenceConfig, orch: OrchestratorConfig
) -> OrchestratorConfig:
    """Validate the three files of a one-shot run; returns orch with defaults filled from train."""
    orch = fill_orchestrator_model(orch, train.model)
    problems = []
    if train.model != infer.model:
        problems.append(
            f"train model '{train.model}' differs from infer model '{infer.model}'; use the same model"
        )
    problems += check_trainer_orchestrator(train, orch, colocated=True)
    problems += check_inference(infer, train, orch)
    if infer.quantization is not None and infer.quantization not in BORROWABLE_QUANTIZATIONS:
        problems.append(
            f"infer quantization '{infer.quantization}': the co-located trainer can borrow unquantized or "
            f"FP8 weights only; use one of {sorted(BORROWABLE_QUANTIZATIONS)} or null"
        )
    if infer.quantization is not None and (train.qlora_bnb or train.qlora_fp8):
        problems.append(
            f"infer quantization '{infer.quantization}' with train qlora_bnb/qlora_fp8: the trainer borrows "
            "the engine's quantized weights as they are; set qlora_bnb and qlora_fp8 to false"
        )
    problems += fp8_problems(infer.quantization)
    if train.ckpt.interval != orch.ckpt.interval:
        problems.append(
            f"ckpt.interval differs: train {train.ckpt.interval}, orch {orch.ckpt.interval}; a co-located run "
            "resumes from a step both sides checkpointed: set the same value (e.g. --train.ckpt.interval N)"
        )
    elif orch.ckpt.keep_last is not None and orch.ckpt.interval is not None:
        min_keep = orch.max_async_level + 2
        if orch.ckpt.keep_last < min_keep:
            problems.append(
                f"orch ckpt.keep_last {orch.ckpt.keep_last}: the orchestrator's checkpoints run up to "
                f"max_async_level + 1 steps ahead of the trainer's, so a resume needs the last {min_keep}; "
                f"set keep_last >= {min_keep}"
            )
    if orch.client.elastic is not None:
        problems.append(
            "orch client.elastic discovers servers of the multi-process mode; a co-located run samples from "
            "its own engines (infer dp N for more): remove client.elastic"
        )
    if infer.tp > 1:
        problems.append(
            f"infer tp {infer.tp}: a co-located trainer rank borrows the weights of one engine worker; set tp: 1 "
            "(dp: N runs N engines, one per trainer rank), or use the multi-process mode"
        )
    streaming = streaming_trainer_problem(orch.streaming.groups_per_part, infer.dp)
    if streaming is not None:
        problems.append(streaming)
    if infer.dp > 1 and not train.lora:
        problems.append(
            f"infer dp {infer.dp} with train lora false: co-located data parallelism trains LoRA adapters over "
            "each engine's own weights; set lora: true, or train full weights in the multi-process mode"
        )
    if problems:
        raise ConfigError("\n".join(f"config mismatch: {p}" for p in problems))
    return orch
