"""Checks across the three config files of one run.

Each file can be valid on its own and the run still be broken: a trainer waiting forever for a
batch written to another folder, an adapter rank the server cannot load. Settings two files hold
(max_steps, the transports, ...) are reconciled by grpo.config.across_files.shared_facts; the relations between
different settings (seq_len within sequence_len, a LoRA rank the server can load) are checked here,
at load time, before anything starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from grpo.config.across_files.derived import derive
from grpo.config.across_files.shared_facts import File, reconcile
from grpo.config.errors import ConfigError
from grpo.config.inference import InferenceConfig
from grpo.config.machine.cpu_defaults import runs_on_cpu, with_cpu_defaults
from grpo.config.machine.engine_dtype import dtype_problems
from grpo.config.machine.fp8_support import fp8_problems
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.sections.streaming import streaming_trainer_problem
from grpo.config.trainer import TrainerConfig


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


def check_trainer_orchestrator(train: TrainerConfig, orch: OrchestratorConfig) -> list[str]:
    """Relations between train.yaml and orch.yaml (the settings both hold are grpo.config.across_files.shared_facts')."""
    problems = []
    normalization = loss_normalization_problem(
        orch.advantage.type, train, orch.batch_size, orch.sampling.max_tokens
    )
    if normalization is not None:
        problems.append(normalization)
    if train.lora and orch.model.lora_adapter is None:
        problems.append("train lora is true but orch model.lora_adapter is null; set it (e.g. 'default')")
    if not train.lora and orch.model.lora_adapter is not None:
        problems.append(
            "train lora is false (full fine-tuning) but orch model.lora_adapter is set; set it to null"
        )
    if orch.seq_len > train.sequence_len:
        problems.append(
            f"orch seq_len ({orch.seq_len}) exceeds train sequence_len ({train.sequence_len}); "
            "packed rows would not fit the trainer"
        )
    streaming = streaming_trainer_problem(
        orch.streaming.groups_per_part, train.gpus, train.backend, train.num_iterations
    )
    if streaming is not None:
        problems.append(streaming)
    if train.backend == "megatron" and orch.sampling.truncates:
        problems.append(
            "orch sampling top_k/top_p/min_p truncate vLLM's distribution and backend megatron does not "
            "reproduce the truncation (its logits are split over tensor-parallel ranks); use backend hf "
            "or set sampling top_k: 0, top_p: 1.0, min_p: 0.0"
        )
    if train.backend == "megatron" and orch.consistency_check.interval is not None:
        problems.append(
            "orch consistency_check runs on backend hf only (megatron's logits are split over tensor-parallel "
            "ranks); set consistency_check.interval: null, or use backend hf"
        )
    if train.loss.kl_beta > 0 and orch.sampling.truncates:
        problems.append(
            "train loss.kl_beta > 0 with orch sampling top_k/top_p/min_p: the reference KL would compare "
            "the trainer's truncated distribution with the reference's whole one; set loss.kl_beta: 0 or "
            "sampling top_k: 0, top_p: 1.0, min_p: 0.0"
        )
    if train.loss.teacher_tau > 0 and orch.teacher_model is None:
        problems.append(
            "train loss.teacher_tau > 0 needs orch teacher_model (the teacher's logprobs come from it)"
        )
    return problems


def check_inference(
    infer: InferenceConfig, train: TrainerConfig | None, orch: OrchestratorConfig
) -> list[str]:
    problems = []
    if orch.model.lora_adapter is not None and not infer.enable_lora:
        problems.append("orch serves a LoRA adapter but infer enable_lora is false; set enable_lora: true")
    rank = train.lora_rank if train is not None and train.lora else orch.model.lora_rank
    if infer.enable_lora and rank is not None and infer.served_lora_rank < rank:
        problems.append(
            f"infer max_lora_rank ({infer.max_lora_rank}) is below the LoRA rank ({rank}); set max_lora_rank >= {rank}"
        )
    max_tokens = orch.sampling.max_tokens
    if infer.max_model_len is not None and max_tokens is not None and max_tokens >= infer.max_model_len:
        problems.append(
            f"orch sampling.max_tokens ({max_tokens}) leaves no room for the prompt in infer max_model_len "
            f"({infer.max_model_len}); raise max_model_len or lower max_tokens"
        )
    if infer.max_model_len is not None and max_tokens is None and infer.max_model_len < orch.seq_len:
        problems.append(
            f"orch sampling.max_tokens null asks for up to seq_len ({orch.seq_len}) tokens per request, more than "
            f"infer max_model_len ({infer.max_model_len}) holds; set max_tokens, or max_model_len >= seq_len"
        )
    wanted = orch.consistency_check.top_logprobs
    if (
        orch.consistency_check.interval is not None
        and infer.max_logprobs != -1
        and (wanted == -1 or wanted > infer.max_logprobs)
    ):
        problems.append(
            f"orch consistency_check.top_logprobs ({wanted}) is more than infer max_logprobs ({infer.max_logprobs}) "
            f"lets a request ask for; set max_logprobs: {wanted} in the inference config"
        )
    if orch.sampling.max_tokens is not None and orch.sampling.max_tokens >= orch.seq_len:
        problems.append(
            f"orch sampling.max_tokens ({orch.sampling.max_tokens}) leaves no room for the prompt in "
            f"seq_len ({orch.seq_len}); lower max_tokens or raise max_seq_len (or seq_len)"
        )
    return problems


def borrowing_problems(train: TrainerConfig) -> list[str]:
    """What the HF trainer refuses once it holds the engine's borrowed base weights
    (grpo.trainer.hf.model.build_policy), found at load time: a co-located run with backend hf
    always borrows (backend megatron trains its own copy)."""
    if train.backend == "megatron":
        return []
    problems = []
    if not train.lora:
        problems.append(
            "train lora false (full fine-tuning) in a co-located run: the trainer borrows the engine's base weights, "
            "which stay frozen; set lora: true, use backend: megatron, or train full weights in the multi-process mode"
        )
    if train.qlora_bnb or train.qlora_fp8:
        problems.append(
            "train qlora_bnb/qlora_fp8 in a co-located run: the trainer borrows the engine's base weights as the engine "
            "holds them instead of quantizing its own from disk; set qlora_bnb and qlora_fp8 to false (infer "
            "quantization: fp8_per_block quantizes the shared base), or use the multi-process mode"
        )
    return problems


BORROWABLE_QUANTIZATIONS = frozenset({"fp8", "fp8_per_block"})
"""vLLM quantization methods whose weight layout grpo.colocate knows (FP8 data + scales)."""


def check_colocated(
    train: TrainerConfig,
    infer: InferenceConfig,
    orch: OrchestratorConfig,
    sources: Mapping[File, str] | None = None,
    on_cuda: bool | None = None,
) -> tuple[TrainerConfig, InferenceConfig, OrchestratorConfig]:
    """Validate the three files of a one-shot run: the settings they share reconciled (a value set in
    one file reaches the others, grpo.config.across_files.shared_facts), then the relations between them.
    `sources` names the files in messages; `on_cuda` is the device the run is checked for (None: a
    CUDA device is used when one is visible). Returns the reconciled configs."""
    shared = derive(reconcile({"train": train, "infer": infer, "orch": orch}, sources), sources)
    if runs_on_cpu(cast(TrainerConfig, shared["train"]), on_cuda):
        shared = with_cpu_defaults(shared, sources)
    train = cast(TrainerConfig, shared["train"])
    infer = cast(InferenceConfig, shared["infer"])
    orch = cast(OrchestratorConfig, shared["orch"])
    problems = check_trainer_orchestrator(train, orch)
    problems += check_inference(infer, train, orch)
    if infer.quantization is not None and infer.quantization not in BORROWABLE_QUANTIZATIONS:
        problems.append(
            f"infer quantization '{infer.quantization}': the co-located trainer can borrow unquantized or "
            f"FP8 weights only; use one of {sorted(BORROWABLE_QUANTIZATIONS)} or null"
        )
    problems += borrowing_problems(train)
    if train.routing_replay and not infer.return_routed_experts:
        problems.append(
            "train routing_replay needs the engine's routing: set return_routed_experts: true in the inference "
            "config, or routing_replay: false"
        )
    problems += fp8_problems(infer.quantization, cuda_available=on_cuda)
    problems += dtype_problems(infer, on_cuda)
    if orch.ckpt.keep_last is not None and orch.ckpt.interval is not None:
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
    if train.weight_broadcast.type == "nccl":
        problems.append(
            "weight_broadcast type nccl: a co-located run loads each policy into its own engine, on the trainer's "
            "GPU, where NCCL cannot join both; set weight_broadcast type filesystem (or remove it) in train.yaml "
            "and orch.yaml"
        )
    if infer.tp > 1:
        problems.append(
            f"infer tp {infer.tp}: a co-located trainer rank borrows the weights of one engine worker; set tp: 1 "
            "(dp: N runs N engines, one per trainer rank), or use the multi-process mode"
        )
    streaming = streaming_trainer_problem(
        orch.streaming.groups_per_part, infer.dp, train.backend, train.num_iterations
    )
    if streaming is not None:
        problems.append(streaming)
    if infer.dp > 1 and not train.lora and train.backend == "megatron":
        problems.append(
            f"infer dp {infer.dp} with train lora false: co-located data parallelism trains LoRA adapters over "
            "each engine's own weights; set lora: true, or train full weights in the multi-process mode"
        )
    if problems:
        raise ConfigError("\n".join(f"config mismatch: {p}" for p in problems))
    return train, infer, orch
