"""How memory is split between the trainer and vLLM in co-located mode.

The trainer borrows the engine's base weights, so its own footprint is what is left: LoRA
parameters with gradients and optimizer state (backend megatron borrows nothing: its own copy of
every weight, fp32 main weights, gradients and Adam moments), activations of one micro-batch (with
backend megatron also its attention scores), dequantization buffers and temporaries (for quantized
weights of its own or borrowed FP8 ones), embeddings/lm_head and a fixed runtime overhead. vLLM
gets the rest (minus a safety margin) for weights + KV cache. A user's gpu_memory_utilization /
kv_cache_space_gb is an upper bound, never raised.

On GPU the result is vLLM's gpu_memory_utilization; on CPU it is the KV-cache size in GiB
(VLLM_CPU_KVCACHE_SPACE), capped by what the configured load needs. On CPU the plan bounds what
each process holds at its peak (tests/colocate/test_memory_plan_holds.py measures it): the engine
process's weights in its dtype (a shared copy the trainer borrows and a packed one), its KV cache
in the whole GiB vLLM takes, and its runtime; the grpo process's trainer rows and its runtime
(torch, the API server, the orchestrator). The trainer's micro-batch budget and activations are
planned against at most CPU_TRAINER_PLANNED_GIB: a 2-core CPU trains a few thousand tokens a step,
and half the machine reserved for activations would leave too little for the engine and the rest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig
from grpo.models.shape import ModelShape
from grpo.trainer.activation_plan import (
    ACTIVATION_TENSORS_ONE_LAYER,
    ACTIVATION_TENSORS_PER_LAYER_KEPT,
    activation_bytes,
    num_recomputed_layers,
    resolved_for_memory,
    tokens_without_recompute,
)
from grpo.trainer.logprobs import logprob_chunk_tokens
from grpo.utils.errors import UserError

GIB = 1024**3
SAFETY_MARGIN = 0.10
GPU_FIXED_OVERHEAD = 2.5 * GIB  # CUDA context, cuDNN/cuBLAS workspaces, allocator fragmentation
CPU_FIXED_OVERHEAD = 1.0 * GIB  # Python, torch, tokenizer, vLLM API server in this process
MIN_CPU_KV_CACHE_GB = 0.25
# The engine's processes besides its weights and KV cache: on vLLM 0.32, SmolLM2-135M, measured at
# peak (VmHWM) 0.71 GB for EngineCore and 1.33 GB for the Worker's Python, torch, oneDNN and
# compiled graphs.
CPU_ENGINE_OVERHEAD = 2.25 * GIB
CPU_TRAINER_PLANNED_GIB = 12.0
"""On CPU, the most memory the trainer's micro-batch budget and activations are planned against
(grpo.trainer.activation_plan.ACTIVATION_SHARE of it for the activations alive at once) when
activation_memory_gib is unset. A float32 trainer (a CPU run's default) keeps twice a bf16 one's
bytes a token: at 8 GiB a long-brief step (1,800 tokens, its brief shared) recomputed 8 of
SmolLM2-135M's 30 layers; 12 GiB keeps 2,500 tokens' activations (about half of a 24 GiB machine
planned in all)."""
# Bytes per LoRA parameter: fp32 weight + fp32 grad + optimizer moments (8-bit: 2 x 1 B; else 2 x 4 B).
LORA_BYTES = {"adamw": 4 + 4 + 8, "adamw_8bit": 4 + 4 + 2}
# Bytes per base parameter for full fine-tuning (fp32 master + grad + moments; bf16 copy is the engine's).
FULL_BYTES = {"adamw": 4 + 4 + 8, "adamw_8bit": 4 + 4 + 2}
# backend megatron borrows nothing: its own bf16 weights + fp32 main weights + fp32 grads + Adam moments.
MEGATRON_BYTES = 2 + 4 + 4 + 8
# backend megatron's attention (megatron-core's local DotProductAttention, and Transformer Engine's
# unfused one, which the arbitrary tree mask selects: grpo.trainer.megatron.layer_spec) materialises
# scores [B, heads, L, L] per layer. Per score, with bf16 compute and the softmax in fp32, a layer
# keeps the fp32 softmax output and its bf16 copy for backward; the layer being worked on adds the
# shared bf16 score buffer and two fp32 gradients of its softmax backward (4 + 4 - the bf16 copy
# already freed + 2). fp32 compute keeps less (one fp32 tensor). Measured on an H200 (megatron-core's
# local attention, bf16, 2/4/6 layers, 2 heads x 2048^2 scores): exactly the fp32 and bf16 copy kept
# per layer, a step's peak above the activation rows 23.6/36.8/49.9 B per score = 6.56 B per layer
# + 10.5 B. The plan counts 1 B per layer beyond the kept copies and 12 B working.
ATTENTION_SCORE_KEPT_BYTES = 4 + 2
ATTENTION_SCORE_LAYER_MARGIN_BYTES = 1
ATTENTION_SCORE_WORKING_BYTES = 12


@dataclass
class MemoryPlan:
    device: str
    total_bytes: int
    rows: list[tuple[str, int, str]] = field(default_factory=list)
    """(component, bytes, how it was estimated) of the trainer's footprint."""
    engine_bytes: int = 0
    engine_rows: list[tuple[str, int, str]] = field(default_factory=list)
    """(component, bytes, how) of the engine process on CPU (empty on GPU: engine_bytes only)."""
    shared_weight_bytes: int = 0
    """The engine's weights the trainer borrows: counted in the engine's rows, mapped in both processes."""
    gpu_memory_utilization: float | None = None
    kv_cache_space_gb: float | None = None
    notes: list[str] = field(default_factory=list)
    micro_batch_tokens: int | None = None
    """The trainer's micro-batch budget (train and orch `micro_batch_tokens`)."""
    activation_memory_gib: float | None = None
    """What gradient_checkpointing auto decides against (train `activation_memory_gib`)."""

    @property
    def trainer_bytes(self) -> int:
        return sum(b for _, b, _ in self.rows)

    def apply(self, infer: InferenceConfig) -> InferenceConfig:
        """The inference config with the planned memory settings."""
        update: dict[str, object] = {}
        if self.gpu_memory_utilization is not None:
            update["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.kv_cache_space_gb is not None:
            update["kv_cache_space_gb"] = self.kv_cache_space_gb
        return infer.model_copy(update=update)

    def apply_train(self, train: TrainerConfig) -> TrainerConfig:
        """The trainer config with the planned micro-batch budget and activation memory."""
        update: dict[str, object] = {}
        if self.micro_batch_tokens is not None:
            update["micro_batch_tokens"] = self.micro_batch_tokens
        if self.activation_memory_gib is not None:
            update["activation_memory_gib"] = self.activation_memory_gib
        return train.model_copy(update=update)

    def apply_orch(self, orch: OrchestratorConfig) -> OrchestratorConfig:
        """The orchestrator config packing rows of the trainer's micro-batch budget."""
        if self.micro_batch_tokens is None:
            return orch
        return orch.model_copy(update={"micro_batch_tokens": self.micro_batch_tokens})

    def table(self) -> str:
        lines = [f"memory plan ({self.device}, {self.total_bytes / GIB:.1f} GiB total)"]
        width = max(len(name) for name, _, _ in self.rows) if self.rows else 10
        for name, nbytes, how in self.rows:
            lines.append(f"  trainer  {name:<{width}}  {nbytes / GIB:8.3f} GiB  {how}")
        lines.append(f"  trainer  {'total':<{width}}  {self.trainer_bytes / GIB:8.3f} GiB")
        for name, nbytes, how in self.engine_rows:
            lines.append(f"  vLLM     {name:<{width}}  {nbytes / GIB:8.3f} GiB  {how}")
        engine = "total" if self.engine_rows else "weights + KV cache"
        lines.append(f"  vLLM     {engine:<{width}}  {self.engine_bytes / GIB:8.3f} GiB")
        if self.gpu_memory_utilization is not None:
            lines.append(f"  -> infer gpu_memory_utilization = {self.gpu_memory_utilization:.3f}")
        if self.kv_cache_space_gb is not None:
            lines.append(f"  -> infer kv_cache_space_gb = {self.kv_cache_space_gb:.2f}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def sizes(self, orch: OrchestratorConfig) -> str:
        """The sizes that drive a run's memory and step time, in one line (with max_async_level, which a
        CPU run may have taken from grpo.config.machine.cpu_defaults)."""
        parts = [
            f"batch_size {orch.batch_size} ({orch.num_groups_per_step} prompts x {orch.rollouts_per_example})",
            f"sampling.max_tokens {orch.sampling.max_tokens}",
            f"seq_len {orch.seq_len}",
            f"max_async_level {orch.max_async_level}",
        ]
        if self.micro_batch_tokens is not None:
            parts.append(f"micro_batch_tokens {self.micro_batch_tokens}")
        if self.activation_memory_gib is not None:
            parts.append(f"activation_memory_gib {self.activation_memory_gib:.2f}")
        if self.kv_cache_space_gb is not None:
            parts.append(f"kv_cache_space_gb {math.ceil(self.kv_cache_space_gb)}")
        if self.gpu_memory_utilization is not None:
            parts.append(f"gpu_memory_utilization {self.gpu_memory_utilization:.3f}")
        return f"sizes ({self.device}): " + ", ".join(parts)

    def write(self, run_dir: Path) -> Path:
        """memory_plan.json in the run dir: what each process is planned to hold at most, in bytes."""
        path = run_dir / "memory_plan.json"
        record = {
            "device": self.device,
            "total_bytes": self.total_bytes,
            "trainer_bytes": self.trainer_bytes,
            "engine_bytes": self.engine_bytes,
            "shared_weight_bytes": self.shared_weight_bytes,
            "trainer_rows": [{"name": n, "bytes": b, "how": h} for n, b, h in self.rows],
            "engine_rows": [{"name": n, "bytes": b, "how": h} for n, b, h in self.engine_rows],
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
        return path


def _device_memory(train: TrainerConfig) -> tuple[str, int]:
    from grpo.utils.device import cuda_device_facts, cuda_present

    # Asked without initialising CUDA here: vLLM's engine is forked from this process later.
    if train.device != "cpu" and cuda_present():
        facts = cuda_device_facts()
        return f"cuda:{facts.index} {facts.name}", facts.total_bytes
    if train.device == "cuda":
        raise UserError("train device is 'cuda' but no CUDA device is visible; set device: auto or cpu")
    import psutil

    return "cpu", int(psutil.virtual_memory().available)


def dequantized_format(train: TrainerConfig, engine_quantization: str | None) -> str | None:
    """The quantized format whose weights the trainer dequantizes per matmul: its own base's
    (qlora_*), or, co-located, the FP8 weights it borrows from the engine (backend hf only)."""
    if train.quantization != "none":
        return train.quantization
    if engine_quantization is None or train.backend == "megatron":
        return None
    return "fp8"


def _activation_kind(shape: ModelShape) -> str:
    """The trainer's compute dtype as the plan names it: 16-bit (bf16, or fp16 on a GPU that lacks
    bf16) or float32."""
    return "fp32" if shape.activation_value_bytes == 4 else "bf16"


def trainer_rows(
    train: TrainerConfig, shape: ModelShape, on_gpu: bool, engine_quantization: str | None = None
) -> list[tuple[str, int, str]]:
    tokens = train.micro_batch_token_budget
    h, vocab = shape.hidden_size, shape.vocab_size
    rows: list[tuple[str, int, str]] = []
    if train.lora:
        num = shape.num_lora_params(train.lora_rank, train.lora_target_modules)
        per = LORA_BYTES[train.optimizer]
        rows.append(
            (
                "LoRA parameters",
                num * per,
                f"{num / 1e6:.2f}M params x {per} B (weight, grad, {train.optimizer})",
            )
        )
    elif train.backend == "megatron":
        num = shape.num_linear_params() + (1 if shape.tied_embeddings else 2) * vocab * h
        rows.append(
            (
                "megatron parameters",
                num * MEGATRON_BYTES,
                f"{num / 1e6:.1f}M params x {MEGATRON_BYTES} B (own bf16 copy, fp32 main, grad, Adam)",
            )
        )
    else:
        num = shape.num_linear_params() + (1 if shape.tied_embeddings else 2) * vocab * h
        per = FULL_BYTES[train.optimizer]
        rows.append(
            (
                "full parameters",
                num * per,
                f"{num / 1e6:.1f}M params x {per} B (master, grad, {train.optimizer})",
            )
        )
    # Recomputing, a layer keeps only its input for backward and one layer's tensors are live at a
    # time; otherwise every layer keeps its own until backward reaches it.
    if train.backend == "megatron":
        num_recomputed = shape.num_layers if train.megatron.recompute == "full" else 0
    else:
        num_recomputed = num_recomputed_layers(train, shape.num_layers)
    kept = activation_bytes(shape, tokens, num_recomputed)
    kind = _activation_kind(shape)
    reserved = train.backend == "hf" and train.gradient_checkpointing == "auto"
    if reserved and train.activation_memory_gib is not None:
        kept = int(train.activation_memory_gib * GIB)
        how = "reserved for an accumulation group (gradient_checkpointing auto, see note)"
    elif num_recomputed == 0:
        how = f"{ACTIVATION_TENSORS_PER_LAYER_KEPT} {kind} tensors per layer, every layer's kept"
    elif num_recomputed == shape.num_layers:
        how = f"one layer's {ACTIVATION_TENSORS_ONE_LAYER} {kind} tensors, each layer's input (recomputed)"
    else:
        how = (
            f"{ACTIVATION_TENSORS_PER_LAYER_KEPT} {kind} tensors per kept layer, one layer's "
            f"{ACTIVATION_TENSORS_ONE_LAYER} and each recomputed layer's input ({num_recomputed} recomputed)"
        )
    logits = min(tokens, logprob_chunk_tokens(train.logprob_chunk_size, on_gpu)) * vocab * 4 * 3
    rows.append(("activations", kept + logits, f"{tokens} tokens: {how}, logits chunk"))
    if train.backend == "megatron":
        rows.append(megatron_attention_scores_row(train, shape))
    dequantized = dequantized_format(train, engine_quantization)
    if dequantized is not None:
        rows.append(
            (
                "dequant buffers",
                3 * shape.max_linear_numel() * 2,
                "3 bf16 buffers of the largest linear weight",
            )
        )
    if dequantized == "fp8":
        from grpo.trainer.hf.dequant import DEQUANT_CHUNK_BYTES

        rows.append(
            (
                "dequant temporaries",
                min(DEQUANT_CHUNK_BYTES, 4 * shape.max_linear_numel()),
                f"one fp32 chunk of FP8 rows (at most {DEQUANT_CHUNK_BYTES // 2**20} MiB)",
            )
        )
    if train.recipe == "fp8_hybrid":
        # One linear at a time: its weight's FP8 cast and a transposed copy for the backward
        # matmul, and its input's and output gradient's casts (torchao keeps the 16-bit tensors
        # for backward and casts again there, so the activations above are unchanged).
        widest = max(h, shape.intermediate_size)
        rows.append(
            (
                "fp8 casts",
                2 * shape.max_linear_numel() + 2 * tokens * widest,
                "recipe fp8_hybrid: the largest linear's weight twice and two token-wide tensors, 1 B each",
            )
        )
    num_embed = 1 if shape.tied_embeddings else 2
    # in the trainer's dtype, as its activations
    width = shape.activation_value_bytes
    rows.append(("embeddings + lm_head", num_embed * vocab * h * width, f"{kind}, loaded from disk"))
    if not on_gpu and width < 4:
        # The CPU float32 head multiplies a float32 copy of the 16-bit weight; a frozen one's is kept
        # (grpo.trainer.float32_logits.float32_copy).
        rows.append(("lm_head float32 copy", vocab * h * 4, "the CPU float32 head's operand"))
    if shape.num_vision_params:
        rows.append(
            (
                "vision tower",
                shape.num_vision_params * 2,
                f"{shape.num_vision_params / 1e6:.2f}M params, bf16, loaded from disk (not borrowed)",
            )
        )
    rows.append(
        (
            "fixed overhead",
            int(GPU_FIXED_OVERHEAD if on_gpu else CPU_FIXED_OVERHEAD),
            "runtime, workspaces, fragmentation",
        )
    )
    return rows


def max_step_tokens(orch: OrchestratorConfig) -> int:
    """Most tokens a step's rows can hold: every sample at most seq_len, and with shared prefixes
    and a max_tokens each group's other completions add at most that many each (single-turn; a
    larger group of multi-turn rollouts stays within the reserve: auto then recomputes more layers)."""
    if orch.shared_prefix and orch.sampling.max_tokens is not None:
        per_group = orch.seq_len + (orch.rollouts_per_example - 1) * orch.sampling.max_tokens
        return orch.num_groups_per_step * per_group
    return orch.batch_size * orch.seq_len


def megatron_attention_scores_row(train: TrainerConfig, shape: ModelShape) -> tuple[str, int, str]:
    """backend megatron's [B, heads, L, L] attention scores at their largest: a padded call holds
    B x L <= the micro-batch's tokens with L <= sequence_len (grpo.trainer.packing.padded_forwards;
    backend megatron's rows hold whole samples: a co-located plan leaves its budget at
    per_device_train_batch_size x sequence_len),
    and tensor parallelism splits the heads. Every layer keeps its scores for backward unless
    megatron.recompute recomputes attention (selective or full: one layer's at a time). With
    pipeline stages a micro-batch's pieces share one call padded to the longest, which can hold
    more (many short pieces beside a long one)."""
    tokens = train.micro_batch_token_budget
    num_heads = shape.num_heads // train.megatron.tensor_model_parallel_size
    num_scores = tokens * train.sequence_len * num_heads
    recomputes = train.megatron.recompute in ("selective", "full")
    num_layers_kept = 1 if recomputes else shape.num_layers
    per_layer = ATTENTION_SCORE_KEPT_BYTES + ATTENTION_SCORE_LAYER_MARGIN_BYTES
    per_score = num_layers_kept * per_layer + ATTENTION_SCORE_WORKING_BYTES
    which = "one layer's (recomputed)" if recomputes else "every layer's"
    return (
        "attention scores",
        num_scores * per_score,
        f"[B, {num_heads} heads, L, L], B x L = {tokens}, L = {train.sequence_len}: {which} "
        f"{per_layer} B kept per layer + {ATTENTION_SCORE_WORKING_BYTES} B working per score",
    )


def plan_memory(
    train: TrainerConfig,
    infer: InferenceConfig,
    orch: OrchestratorConfig,
    model_path: str | Path,
    gpu: tuple[str, float] | None = None,
) -> MemoryPlan:
    """`gpu` (name, GiB): plan for that GPU instead of this machine's device (grpo --plan-gpu-gib)."""
    shape = ModelShape.from_folder(model_path)
    device, total = ("cuda " + gpu[0], int(gpu[1] * GIB)) if gpu is not None else _device_memory(train)
    on_gpu = device.startswith("cuda")
    plan = MemoryPlan(device=device, total_bytes=total)
    if train.backend == "hf":
        # The hf trainer computes in the dtype of the engine weights it borrows.
        from grpo.config.machine.engine_dtype import resolve_engine_dtype

        width = 4 if resolve_engine_dtype(infer, on_cuda=on_gpu) == "float32" else 2
        shape = replace(shape, activation_value_bytes=width)
        planned = total if on_gpu else min(total, int(CPU_TRAINER_PLANNED_GIB * GIB))
        train, choice = resolved_for_memory(train, shape, planned, max_step_tokens(orch))
        plan.micro_batch_tokens = train.micro_batch_tokens
        plan.activation_memory_gib = train.activation_memory_gib
        plan.notes.append(
            f"micro-batch budget {train.micro_batch_token_budget} tokens (train/orch micro_batch_tokens; "
            "a group's prefix tree stays in one row when it fits)"
        )
        if train.gradient_checkpointing == "auto":
            assert train.activation_memory_gib is not None
            budget = int(train.activation_memory_gib * GIB)
            plan.notes.append(
                f"gradient checkpointing auto, per accumulation group: off up to "
                f"{tokens_without_recompute(shape, budget)} tokens alive at once; the planned worst case: "
                + choice.describe(shape.num_layers).removeprefix("gradient checkpointing ")
            )
        else:
            plan.notes.append(choice.describe(shape.num_layers))
    plan.rows = trainer_rows(train, shape, on_gpu, engine_quantization=infer.quantization)
    num_replicas = infer.dp  # co-located dp: one engine + one trainer rank per replica
    if on_gpu:
        usable = total * (1 - SAFETY_MARGIN) - plan.trainer_bytes
        if num_replicas > 1:
            plan.notes.append(f"per GPU: each of the {num_replicas} replicas (infer dp) has its own GPU")
        fraction = usable / total
        if fraction <= 0.05:
            raise UserError(
                f"the trainer needs about {plan.trainer_bytes / GIB:.1f} GiB of {total / GIB:.1f} GiB: nothing is left "
                "for vLLM; lower micro_batch_tokens, sequence_len or per_device_train_batch_size, or use qlora_bnb"
            )
        plan.gpu_memory_utilization = round(min(fraction, infer.gpu_memory_utilization), 3)
        plan.engine_bytes = int(plan.gpu_memory_utilization * total)
        return plan

    # CPU: the replicas share this machine's RAM, and vLLM's own weights live in it too.
    usable = (total * (1 - SAFETY_MARGIN) - num_replicas * plan.trainer_bytes) / num_replicas
    from grpo.config.machine.engine_dtype import resolve_engine_dtype

    engine_dtype = resolve_engine_dtype(infer, on_cuda=False)
    bytes_per_weight = 4 if engine_dtype == "float32" else 2
    weight_bytes = (
        shape.num_linear_params()
        + (1 if shape.tied_embeddings else 2) * shape.vocab_size * shape.hidden_size
        + shape.num_vision_params
    ) * bytes_per_weight
    max_len = infer.max_model_len or orch.seq_len
    num_seqs = -(-int(orch.batch_size * orch.oversampling_factor) // num_replicas)  # per engine
    needed_gb = num_seqs * max_len * shape.kv_bytes_per_token() / GIB
    # The engine keeps dense and packed copies of its weights on CPU.
    room_gb = (usable - 2 * weight_bytes - CPU_ENGINE_OVERHEAD) / GIB
    cap = (
        infer.kv_cache_space_gb
        if infer.kv_cache_space_gb is not None
        else max(needed_gb, MIN_CPU_KV_CACHE_GB)
    )
    kv_gb = min(cap, room_gb)
    if kv_gb < MIN_CPU_KV_CACHE_GB:
        raise UserError(
            f"only {room_gb:.2f} GiB of RAM would be left for vLLM's KV cache; free memory or lower sequence_len"
        )
    plan.kv_cache_space_gb = round(max(kv_gb, MIN_CPU_KV_CACHE_GB), 2)
    plan.shared_weight_bytes = weight_bytes
    plan.engine_rows = [
        (
            "weights",
            2 * weight_bytes,
            f"{bytes_per_weight * 8}-bit, a dense copy (the trainer borrows it) and a packed one",
        ),
        (
            "KV cache",
            math.ceil(plan.kv_cache_space_gb) * GIB,
            "kv_cache_space_gb in the whole GiB vLLM takes (VLLM_CPU_KVCACHE_SPACE)",
        ),
        (
            "runtime",
            int(CPU_ENGINE_OVERHEAD),
            "EngineCore and Worker processes: Python, torch, oneDNN, graphs",
        ),
    ]
    plan.engine_bytes = sum(b for _, b, _ in plan.engine_rows)
    plan.notes.append(
        f"KV cache sized for {num_seqs} sequences x {max_len} tokens ({needed_gb:.2f} GiB needed)"
    )
    if num_replicas > 1:
        plan.notes.append(
            f"per replica: {num_replicas} replicas (infer dp) share the RAM, each an engine and a trainer rank"
        )
    return plan
