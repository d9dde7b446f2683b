"""`train.yaml`: the trainer (`grpo-train`, or the trainer thread of `grpo`).

Field names follow the SFT config the GRPO trainer inherits from (model, sequence_len,
learning_rate, lora_*, ...) plus the GRPO-specific `loss` (grpo.config.sections.loss, re-exported here), `noise_scheduler`, `transport_type`
and `max_async_level`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpo.config.across_files.max_seq_len import fill_length
from grpo.config.base import StrictModel
from grpo.config.keys.renamed_keys import move_renamed_keys
from grpo.config.orchestrator import FilesystemWeightBroadcast, ReportConfig, WeightBroadcastConfig
from grpo.config.sections.loss import LossConfig as LossConfig
from grpo.config.sections.megatron import MegatronConfig

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""What the default targets become on a mixture-of-experts model (attention only; docs/moe.md)."""
RENAMED_KEYS = {"gradient_accumulation_steps": "micro_batches_per_backward"}
"""Old train.yaml key -> its name now (grpo.config.keys.renamed_keys)."""


class NoiseSchedulerConfig(StrictModel):
    enabled: bool = False
    """Add Gaussian noise to the inference model's RMSNorm weights (QeRL)."""

    sigma_start: float = Field(5e-2, ge=0.0)
    """Noise std of the first noisy stage."""

    sigma_end: float = Field(5e-4, ge=0.0)
    """Noise std of the last stage."""

    num_stages: int = Field(10, ge=1)
    """Geometric decay intervals over max_steps; the first has no noise."""


class TrainerCheckpointConfig(StrictModel):
    interval: int | None = Field(None, gt=0)
    """Save adapter/weights, optimizer, scheduler, step and RNG every N steps (null = never)."""

    resume_step: int | None = Field(None, ge=-1)
    """Step to resume from; -1 = the latest complete checkpoint."""

    keep_last: int | None = Field(None, gt=0)
    """Keep at most the N newest checkpoints."""


class TrainerConfig(StrictModel):
    model: str
    """HuggingFace model id or local path."""

    output_dir: str = "output"
    """Run directory shared with the orchestrator, or its parent holding one run_* folder."""

    share_with_group: bool = False
    """Let the owner's group read what the run writes (files 0640, folders 0750); false keeps it to
    the owner alone (0600 / 0700): the run directory holds every prompt and completion, checkpoints
    and the engine's log. Set in one file, it reaches the others."""

    gpus: int = Field(1, ge=1)
    """GPUs to train on (data parallel). More than 1 needs a launch through torchrun with as many
    processes; the trainer refuses to start as a single process otherwise."""

    backend: Literal["hf", "megatron"] = "hf"
    """Training engine. hf: the HF model (LoRA/QLoRA or full; FSDP2 data parallel). megatron:
    full-parameter updates on megatron-core (tensor, pipeline, data and expert parallel; `megatron:`);
    needs lora: false and the `megatron` extra (pip install grpo-rl[megatron])."""

    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """(backend megatron) Parallel sizes and Megatron's knobs."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train: auto = CUDA when present, else CPU."""

    sequence_len: int = Field(1024, gt=0)
    """Maximum tokens per packed micro-batch row. Unset, the orchestrator's seq_len (2048 unless set):
    in a co-located run and with grpo-train's run dir (1024, the default for a file read alone, would
    not hold the orchestrator's default rows)."""

    max_seq_len: int | None = Field(None, gt=0)
    """Longest sequence, prompt + completion: sequence_len, orch seq_len, infer max_model_len default to
    it. One key for the three files (grpo.config.across_files.max_seq_len)."""

    learning_rate: float = Field(2e-4, gt=0.0)
    """Peak learning rate."""

    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""

    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""

    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Floor of the linear/cosine decay as a fraction of learning_rate."""

    max_steps: int = Field(-1, ge=-1)
    """Training steps (-1 = until the orchestrator stops)."""

    logging_steps: int = Field(1, ge=1)
    """Print metrics every N steps (metrics.jsonl gets every step)."""

    micro_batches_per_backward: int = Field(4, ge=1)
    """Micro-batches whose losses are summed and backpropagated in one backward pass, so the most
    micro-batches whose activations are kept at once (1 = least memory). Not gradient accumulation:
    a step always trains on every row the orchestrator sent, as one optimizer update, and the loss
    stays normalised by the step's total loss tokens, so the gradient does not depend on this
    value. Formerly gradient_accumulation_steps (still read, with a warning)."""

    per_device_train_batch_size: int | None = Field(None, ge=1)
    """(backend megatron) Packed rows per micro-batch (null: 2). Refused under backend hf, whose
    micro-batches are sized in tokens (micro_batch_tokens)."""

    micro_batch_tokens: int | None = Field(None, gt=0)
    """Token budget of one micro-batch (backend hf): consecutive rows are forwarded and
    backpropagated together up to this many tokens (a larger row alone), and the orchestrator packs
    rows of at most this many tokens, keeping a group's prefix tree (its shared prompt once) in one
    row whenever the tree fits. null: co-located with backend hf, what the memory plan holds (one
    micro-batch's activations, every layer's kept, within half the memory; at least sequence_len,
    at most 8192); otherwise sequence_len (backend megatron: per_device_train_batch_size x
    sequence_len), and the orchestrator's rows stay seq_len long."""

    optimizer: Literal["adamw", "adamw_8bit"] = "adamw_8bit"
    """adamw_8bit needs bitsandbytes on CUDA; on CPU it falls back to adamw with a warning."""

    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0.0)

    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""

    max_grad_norm: float = Field(1.0, ge=0.0)
    """Gradient clipping norm (0 = no clipping). The grad_norm metric is the norm after clipping,
    grad_norm_before_clip the norm before (docs/loss.md, "Metrics")."""

    recipe: Literal["bf16", "fp8_hybrid", "nvfp4"] = "bf16"
    """Precision recipe: bf16 (on CPU bf16 when the CPU supports it, else fp32; co-located, the
    engine's dtype). fp8_hybrid (backend hf, an SM89+ GPU, torchao): the decoder's linears multiply
    in FP8, E4M3 inputs and weights forward, E5M2 gradients backward, dynamic per-tensor scales;
    weights, LoRA adapters, optimizer state and the lm_head keep the bf16 recipe's precision
    (grpo.trainer.hf.fp8_training). Refused when the trainer starts anywhere else. nvfp4 is an
    accepted name, refused at load: no backend implements it (qlora_fp8 stores base weights in
    FP8 and runs anywhere)."""

    lora: bool = True
    """Train LoRA adapters (false = full-parameter training)."""

    lora_rank: int = Field(16, gt=0)
    """LoRA rank r of the adapters (the server's max_lora_rank follows it)."""

    lora_alpha: float = Field(32, gt=0)
    """LoRA scaling numerator: the adapter's update is scaled by lora_alpha / lora_rank."""

    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    """Module names wrapped with LoRA ("all-linear" allowed). On a mixture-of-experts model the
    default is attention only (q/k/v/o_proj): its experts are fused 3-D parameters, not linears. In
    a vision-language model only the language model's modules: the vision tower is never adapted."""

    train_vision_tower: bool = False
    """Vision-language models: train the vision tower too (full training only; LoRA adapts the
    language model, the only part vLLM applies adapters to). False keeps it frozen."""

    qlora_bnb: bool = False
    """Base weights in bitsandbytes NF4 (QLoRA)."""

    qlora_fp8: bool = False
    """Base weights in FP8 E4M3 with 128x128 block scales, dequantized per matmul. Weight-only:
    matmuls run in bf16/fp32, never as native FP8 matmuls, so any CPU or CUDA GPU works (no SM89+)."""

    qlora_fp4: bool = False
    """Base weights in NVFP4 (SM100+)."""

    routing_replay: bool = False
    """Mixture-of-experts models: route each token through the experts the inference engine chose for
    it (rollout routing replay, R3) instead of the trainer's own top-k; the router's scores for those
    experts are still the trainer's, so the router trains. Needs routing from the engine
    (return_routed_experts: true in the inference config, grpo-infer's or a co-located run's) and one
    GPU (or the CPU), or under backend megatron data- and expert-parallel ranks (no tensor or pipeline
    split) without megatron.recompute: full; metric routing_mismatch_fraction (docs/moe.md)."""

    router_aux_loss_coef: float = Field(0.0, ge=0.0)
    """Mixture-of-experts models: weight of the routers' load-balancing loss (Switch Transformer's, as
    transformers computes it for the family: num_experts * sum_e f_e * P_e over each packed row's
    tokens, pooled over the MoE layers; with routing_replay f counts the replayed experts), added to
    the policy loss with its normalisation; metric router_aux_loss (docs/moe.md). 0 (the default)
    leaves it out: in RL it pulls the routing away from what the rollouts used for no reward.
    Backend hf only."""

    attention: Literal["auto", "flex_attention", "sdpa", "eager"] = "auto"
    """Attention kernel of the HF trainer's decoder (transformers' attn_implementation). auto: on a
    GPU flex_attention, whose block mask skips the blocks a packed row's prefix-tree mask excludes
    (sdpa handed that mask leaves its fused kernels), except for models with attention sinks
    (gpt-oss: eager) and vision-language models (transformers' default); on CPU sdpa, or eager
    where sdpa would drop part of the model (Gemma-2's soft-capped scores). flex_attention needs a
    GPU: torch has no FlexAttention backward on CPU. Backend hf only."""

    gradient_checkpointing: Literal["auto"] | bool | int = "auto"
    """Recompute activations in backward to save memory (backend hf; backend megatron has
    megatron.recompute instead and ignores this). auto: decided for each group of micro-batches
    backpropagated together, from its tokens: off when their activations, every layer's kept, fit
    activation_memory_gib, else the fewest decoder layers recomputed that make them fit (all when
    none does); `grpo --dry-run` prints the threshold and the planned worst case. true: every
    layer; false: none; an integer N: the first N decoder layers."""

    activation_memory_gib: float | None = Field(None, gt=0)
    """Memory the activations of one group of micro-batches may take (gradient_checkpointing auto
    decides against it; a group also keeps its loss tokens' float32 probabilities for backward
    where they fit beside its activations, rather than running the lm_head again, and under auto
    recomputes a few more layers to make that room where their forward costs less). null:
    co-located, what the memory plan reserves for the worst case it plans; otherwise half the
    device's memory (a GPU's total, or the RAM available at start), which under an explicit
    gradient_checkpointing keeps no probabilities."""

    logprob_chunk_size: int | None = Field(None, gt=0)
    """Most tokens per chunk when computing log-probabilities, so the [tokens x vocab] float32
    logits never exist at once (a micro-batch's loss tokens are split into equal chunks). null:
    1024 on a GPU, 128 on CPU, where smaller chunks were faster (grpo.trainer.logprobs)."""

    zero_level: int = Field(1, ge=0, le=3)
    """Only 1 (accepted so configs that set it load); any other value is
    refused, since it would change nothing: multi-rank full-weight training always shards
    parameters, gradients and optimizer states with FSDP2, and LoRA training replicates the (small)
    adapters on every rank and all-reduces their gradients."""

    seed: int = 42
    """Random seed."""

    num_iterations: int = Field(1, ge=1)
    """Optimizer updates per batch (TRL's num_iterations, verl's ppo_epochs): the batch is trained on
    this many times in a row; the first pass's logprobs (detached) are the old logprobs that
    loss.clip_low / clip_high test on the later passes, while the masks and tis_cap stay against the
    behaviour (vLLM) logprobs (docs/loss.md, "Several updates per batch"). A step is still one batch:
    the learning-rate schedule, max_steps, checkpoints and metrics count batches (the loss metrics
    and grad norms are the last update's). Backend hf, one batch per step (no orch streaming)."""

    loss: LossConfig = Field(default_factory=LossConfig)
    noise_scheduler: NoiseSchedulerConfig = Field(default_factory=NoiseSchedulerConfig)

    transport_type: Literal["filesystem", "zmq"] = "filesystem"
    """How batches arrive from the orchestrator."""

    zmq_host: str = "localhost"
    """(zmq) Address the trainer binds for batches."""

    zmq_port: int = Field(5555, ge=1, le=65535)
    """(zmq) Port the trainer binds for batches."""

    zmq_secret_env: str = "GRPO_ZMQ_SECRET"
    """(zmq) Environment variable holding the secret of the batch link: it keys its CURVE
    encryption (a peer without it cannot connect) and the HMAC-SHA256 tag on every message (set
    the same value for grpo-orch). Required when zmq_host is not a loopback address; unset on
    loopback = unauthenticated."""

    weight_broadcast: WeightBroadcastConfig = Field(default_factory=FilesystemWeightBroadcast)
    """How new weights reach inference (LoRA adapters always go through the filesystem)."""

    max_async_level: int = Field(1, ge=0)
    """Must match the orchestrator's; also how many broadcast folders are kept (+1). A co-located run
    on CPU takes 0 where neither file sets it (orch.yaml's max_async_level)."""

    batch_timeout: float | None = Field(None, gt=0)
    """Seconds to wait for a batch before failing with a message (null = wait forever). A batch
    below the step the trainer committed that the transport no longer holds (it never comes)
    fails at once, whatever this is."""

    dist_timeout: float = Field(1800.0, gt=0)
    """(gpus > 1) Seconds a collective between trainer ranks may wait for a rank before the job
    fails (the process group's timeout). Waiting for batches does not count: while rank 0 waits,
    the other ranks wait outside any collective. Raise it when one rank's part of a step (writing a
    checkpoint, publishing a policy) takes longer."""

    ckpt: TrainerCheckpointConfig = Field(default_factory=TrainerCheckpointConfig)
    report_to: ReportConfig | None = None
    """W&B of the trainer's metrics (null = none; they are always in trainer_metrics.jsonl). A run has
    one W&B run, written by the orchestrator's process with the trainer's rows under `trainer/`
    (docs/metrics.md); so in separate processes set report_to in orch.yaml. Co-located, either
    file's report_to opens it (orch.yaml's first)."""

    @model_validator(mode="before")
    @classmethod
    def _read_renamed_keys(cls, data: object) -> object:
        return move_renamed_keys(data, RENAMED_KEYS, "train.yaml")

    @model_validator(mode="before")
    @classmethod
    def _sequence_len_from_max_seq_len(cls, data: object) -> object:
        return fill_length(data, "sequence_len")

    @field_validator("recipe", mode="before")
    @classmethod
    def _accept_hyphenated_recipe(cls, value: object) -> object:
        return value.replace("-", "_") if isinstance(value, str) else value

    @field_validator("gradient_checkpointing")
    @classmethod
    def _layer_count_not_negative(cls, value: Literal["auto"] | bool | int) -> Literal["auto"] | bool | int:
        if not isinstance(value, bool) and isinstance(value, int) and value < 0:
            raise ValueError(
                f"gradient_checkpointing {value}: give auto, true, false or a number of layers >= 0"
            )
        return value

    @field_validator("zero_level")
    @classmethod
    def _zero_level_changes_nothing(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"zero_level {value} would change nothing: multi-rank full-weight training always shards "
                "parameters, gradients and optimizer states (FSDP2) and LoRA training replicates the adapters; "
                "remove zero_level from train.yaml (or set it to 1)"
            )
        return value

    @model_validator(mode="after")
    def _zmq_secret_off_loopback(self) -> TrainerConfig:
        from grpo.utils.auth import open_without_secret

        if self.transport_type == "zmq" and open_without_secret(self.zmq_host, self.zmq_secret_env):
            raise ValueError(
                f"zmq_host {self.zmq_host} accepts batches from other machines, so frames must be signed: "
                f"export {self.zmq_secret_env}=<a long random string> for grpo-train and grpo-orch, "
                "or bind zmq_host: 127.0.0.1"
            )
        return self

    @model_validator(mode="after")
    def _one_quantization(self) -> TrainerConfig:
        chosen = self.quantization_keys
        if len(chosen) > 1:
            raise ValueError(f"choose one base-weight quantization, not {' and '.join(chosen)}")
        if chosen and not self.lora:
            raise ValueError(f"{chosen[0]} needs lora: true (quantized base weights are frozen)")
        return self

    @model_validator(mode="after")
    def _noise_travels_with_filesystem_broadcasts(self) -> TrainerConfig:
        # The collective carries full weights only; the noisy norms are a file in the broadcast
        # folder, which servers on other machines may not see.
        if self.noise_scheduler.enabled and self.weight_broadcast.type == "nccl" and not self.lora:
            raise ValueError(
                "noise_scheduler.enabled with weight_broadcast type nccl and lora false: the QeRL noisy "
                "norms reach the servers only with filesystem broadcasts; set weight_broadcast type "
                "filesystem (here and in orch.yaml), train LoRA adapters, or noise_scheduler.enabled false"
            )
        return self

    @model_validator(mode="after")
    def _recipe_is_implemented(self) -> TrainerConfig:
        # nvfp4 is accepted by the parser so configs naming it get this line rather than a list
        # of allowed values.
        if self.recipe == "nvfp4":
            raise ValueError(
                "recipe nvfp4 is not implemented by either backend (FP4 matmuls need SM100+ and a kernel "
                "grpo does not ship): set recipe: bf16, or fp8_hybrid on an SM89+ GPU"
            )
        if self.recipe == "fp8_hybrid" and self.backend == "megatron":
            raise ValueError(
                "recipe fp8_hybrid is implemented by backend hf only (torchao float8 linears); "
                "use backend: hf, or set recipe: bf16"
            )
        quantized = self.quantization_keys
        if self.recipe == "fp8_hybrid" and quantized:
            raise ValueError(
                f"recipe fp8_hybrid multiplies the base's 16-bit weights in FP8, and {quantized[0]} stores the "
                f"base quantized: choose one (remove {quantized[0]}, or set recipe: bf16)"
            )
        return self

    @model_validator(mode="after")
    def _rows_per_micro_batch_is_megatron_only(self) -> TrainerConfig:
        if self.backend == "hf" and self.per_device_train_batch_size is not None:
            raise ValueError(
                "per_device_train_batch_size is a backend megatron key: backend hf sizes micro-batches in "
                "tokens; remove it, or set micro_batch_tokens (rows x sequence_len)"
            )
        return self

    @model_validator(mode="after")
    def _megatron_trains_full_weights(self) -> TrainerConfig:
        if self.backend == "megatron" and self.lora:
            raise ValueError(
                "backend megatron trains full weights; set lora: false (or backend: hf for LoRA)"
            )
        if self.backend == "megatron" and self.gpus % self.megatron.model_parallel_size != 0:
            mp = self.megatron
            raise ValueError(
                f"gpus {self.gpus} is not a multiple of megatron tensor_model_parallel_size x "
                f"pipeline_model_parallel_size ({mp.tensor_model_parallel_size} x "
                f"{mp.pipeline_model_parallel_size}); set gpus to a multiple of {mp.model_parallel_size}"
            )
        if self.backend == "megatron" and self.megatron.expert_model_parallel_size > 1:
            self._check_expert_parallel()
        return self

    def _check_expert_parallel(self) -> None:
        """What expert parallelism is verified with: experts split over data-parallel ranks only."""
        mp = self.megatron
        ep = mp.expert_model_parallel_size
        if mp.model_parallel_size > 1:
            raise ValueError(
                f"megatron expert_model_parallel_size {ep} is implemented with tensor_model_parallel_size 1 and "
                "pipeline_model_parallel_size 1; set both to 1 (or expert_model_parallel_size: 1)"
            )
        if self.gpus % ep:
            raise ValueError(
                f"gpus {self.gpus} is not a multiple of megatron expert_model_parallel_size {ep}; set gpus to a "
                f"multiple of {ep}"
            )

    @model_validator(mode="after")
    def _knobs_the_backend_implements(self) -> TrainerConfig:
        if self.backend == "megatron" and (self.loss.kl_beta > 0 or self.num_iterations > 1):
            knob = "loss.kl_beta > 0" if self.loss.kl_beta > 0 else f"num_iterations {self.num_iterations}"
            raise ValueError(f"{knob} is implemented by backend hf only; use backend: hf, or remove it")
        if self.backend == "megatron" and self.attention != "auto":
            raise ValueError(
                f"attention: {self.attention} chooses the HF trainer's kernel, and backend megatron computes "
                "attention with megatron-core's own: remove attention, or use backend: hf"
            )
        if self.loss.kl_beta > 0 and not self.lora and self.gpus > 1:
            raise ValueError(
                "loss.kl_beta > 0 with full-parameter training on several GPUs: the frozen reference copy is "
                "not sharded; train LoRA (its reference is the base with adapters disabled) or use gpus: 1"
            )
        return self

    @model_validator(mode="after")
    def _moe_knobs_implemented(self) -> TrainerConfig:
        # Backend megatron replays on data- and expert-parallel ranks (each router sees whole rows).
        replays_on_ranks = self.backend == "megatron" and self.megatron.model_parallel_size == 1
        if self.routing_replay and self.gpus > 1 and not replays_on_ranks:
            raise ValueError(
                "routing_replay on several GPUs is implemented by backend megatron with data or expert "
                "parallelism only; set routing_replay: false, gpus: 1, or megatron tensor_model_parallel_size "
                "and pipeline_model_parallel_size 1"
            )
        if self.routing_replay and self.backend == "megatron" and self.megatron.recompute == "full":
            # The routing of one decoder call is read by the routers during it; recomputation in
            # backward reruns them after later calls (grpo.trainer.megatron.moe.RoutingReplay).
            raise ValueError(
                "routing_replay under backend megatron needs megatron.recompute none or selective, not full"
            )
        if self.router_aux_loss_coef > 0 and self.backend == "megatron":
            raise ValueError(
                "router_aux_loss_coef > 0 is implemented by backend hf only (backend megatron builds its "
                "routers without megatron-core's load-balancing loss); use backend: hf, or set it to 0"
            )
        return self

    @property
    def micro_batch_token_budget(self) -> int:
        """micro_batch_tokens, or its default outside a memory plan."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return self.rows_per_micro_batch * self.sequence_len

    @property
    def rows_per_micro_batch(self) -> int:
        """Whole sequence_len rows a micro-batch holds (backend hf: by default; micro_batch_tokens)."""
        if self.backend == "hf":
            return 1
        return 2 if self.per_device_train_batch_size is None else self.per_device_train_batch_size

    @property
    def quantization_keys(self) -> list[str]:
        """The qlora_* keys set to true, in the order they are declared."""
        return [k for k in ("qlora_bnb", "qlora_fp8", "qlora_fp4") if getattr(self, k)]

    @property
    def quantization(self) -> Literal["none", "nf4", "fp8", "nvfp4"]:
        if self.qlora_bnb:
            return "nf4"
        if self.qlora_fp8:
            return "fp8"
        if self.qlora_fp4:
            return "nvfp4"
        return "none"
