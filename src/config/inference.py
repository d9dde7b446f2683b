"""`infer.yaml`: the vLLM inference server (`grpo-infer`, or the server thread of `grpo`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo.config.across_files.max_seq_len import fill_length
from grpo.config.base import StrictModel
from grpo.config.sections.supervisor import SupervisorConfig

# vLLM accepts only these LoRA ranks; a configured rank is rounded up to the next one.
VALID_VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def round_up_lora_rank(rank: int) -> int:
    """Smallest rank vLLM accepts that is >= `rank`."""
    for valid in VALID_VLLM_LORA_RANKS:
        if valid >= rank:
            return valid
    raise ValueError(
        f"max_lora_rank {rank} exceeds the largest rank vLLM supports ({VALID_VLLM_LORA_RANKS[-1]})"
    )


BITSANDBYTES_NAMES = frozenset({"bitsandbytes", "bnb", "nf4"})
"""Names a user may give bitsandbytes quantization, which vLLM 0.32 does not have."""


class InferenceConfig(StrictModel):
    model: str
    """HuggingFace model id or local path. Ids resolve offline: local path, HF cache, embedded store."""

    host: str | None = None
    """Bind address. null binds 127.0.0.1 (loopback only); set "0.0.0.0" to serve other hosts."""

    port: int = Field(8000, ge=0, le=65535)
    """Bind port (0 picks a free one; the chosen port is logged)."""

    dtype: Literal["auto", "float16", "bfloat16", "float32", "float32_on_cpu"] = "auto"
    """Weight and activation dtype of the engine (and of a co-located trainer, which computes on the
    engine's weights). auto: vLLM's choice on a GPU (the checkpoint's; 16-bit), float32 on a CPU
    (unquantized weights): trainer and engine logprobs agree to ~1e-8 and a LoRA policy merged into
    the served weights keeps every update (grpo.config.machine.engine_dtype). float32 with enable_lora is
    refused on a GPU (vLLM's CUDA LoRA kernels take 16-bit only). float32_on_cpu: float32 on CPU,
    bfloat16 on a GPU."""

    quantization: str | None = None
    """vLLM quantization method for the base weights (vLLM's --quantization), e.g. "fp8" on a GPU or
    "fp8_per_block" (FP8 E4M3, 128x128 block scales; also runs on CPU). null = as the checkpoint is.
    Co-located runs borrow unquantized and FP8 weights; other methods are refused at start, and
    bitsandbytes (NF4), which vLLM 0.32 lacks, at load."""

    max_model_len: int | None = Field(None, gt=0)
    """Maximum context length (prompt + completion); null takes max_seq_len, else the model's."""

    max_seq_len: int | None = Field(None, gt=0)
    """Longest sequence, prompt + completion: max_model_len, train sequence_len, orch seq_len default to
    it. One key for the three files (grpo.config.across_files.max_seq_len)."""

    enforce_eager: bool = False
    """Run vLLM's model eagerly: no CUDA graphs on GPU, no torch.compile (inductor) on CPU (faster to
    start, slower to generate). The two round bf16 differently; a co-located 16-bit trainer follows
    the mode its engine runs in (grpo.trainer.hf.vllm_numerics)."""

    trust_remote_code: bool = False
    """Allow custom model code from the model folder."""

    tp: int = Field(1, ge=1)
    """Tensor parallel degree."""

    dp: int = Field(1, ge=1)
    """Data parallel degree: engine replicas behind one server (grpo-infer); co-located, N replicas,
    each an engine and a trainer rank on its own GPU (docs/colocate.md)."""

    enable_lora: bool = True
    """Serve LoRA adapters and hot-load each new policy's adapter."""

    return_routed_experts: bool = False
    """Mixture-of-experts models: return the experts each token was routed to with every completion,
    for the trainer's routing_replay. On a GPU vLLM's `--enable-return-routed-experts`; on the CPU
    engine grpo records it itself, running the engine without prefix caching (docs/moe.md)."""

    max_lora_rank: int | None = Field(None, gt=0)
    """Largest LoRA rank to serve; rounded up to a rank vLLM accepts. null: the trainer's lora_rank in a
    co-located run (or with grpo-infer --config rl.yaml), else 64."""

    max_loras: int = Field(8, ge=1)
    """Adapters resident in the engine at once."""

    max_cpu_loras: int = Field(100, ge=1)
    """Adapters cached in host memory."""

    lora_serving: Literal["auto", "adapter", "merged"] = "auto"
    """How the engine serves a policy's LoRA adapter. "adapter": vLLM's LoRA path (the adapter is
    applied per request). "merged": each new adapter is merged into the weights the engine serves
    (base + scaling * B @ A, recomputed from the untouched base, so the co-located trainer's
    borrowed base is unchanged) and requests run as the base model: on CPU about 3x the tokens/s of
    the LoRA path (benchmarks/results). vLLM's CPU backend with a float32 engine only (a 16-bit
    merged weight drops small updates); not with tp > 1 or a quantized base. "auto": merged where
    that holds, else adapter."""

    enable_prefix_caching: bool | None = None
    """Prefix caching; null keeps vLLM's default."""

    block_size: int | None = Field(None, gt=0)
    """Tokens per KV-cache block (vLLM's --block-size). Prefix caching shares whole blocks only, so a
    group's completions, scheduled together, share the prompt up to its last whole block and each
    prefill the rest. null: 16 on CPU (the smallest vLLM's CPU attention kernels take; its own
    default, 128, left prompts under 128 tokens prefilled once per completion), 32 on a CPU with AMX
    (its attention kernel takes multiples of 32), vLLM's default on GPU. On CPU a multiple of 16."""

    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may use. In co-located mode this is an upper bound: the
    trainer's estimated needs are taken off first."""

    kv_cache_space_gb: float | None = Field(None, gt=0)
    """CPU only: GiB of host memory for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE). null = 2,
    or the automatic split in co-located mode."""

    weight_broadcast_type: Literal["filesystem", "nccl"] = "filesystem"
    """How new full weights arrive: from a directory, or over a collective (NCCL on GPU, gloo on CPU)."""

    weight_dirs: list[str] | None = None
    """Folders the weight routes may load policies from (full weights, LoRA adapters, noisy norms,
    /v1/load_lora_adapter included); any other path is refused (HTTP 403), so a client cannot make
    the engine read files the run did not write. Relative paths are read from the server's working
    directory. null: that working directory (where grpo-orch's output_dir usually lies). Co-located
    runs use the run's broadcasts folder (where the trainer publishes every policy). / is refused
    (listed, or as the working directory when null): it would admit every file."""

    weight_receive_timeout_s: float = Field(1200, gt=0)
    """(weight_broadcast_type nccl) Longest wait, in seconds, for the trainer when the orchestrator
    asks this server to receive a policy over the collective. The server's own limit: a request
    may ask for a shorter wait (the orchestrator's weight_broadcast.timeout), never a longer one."""

    weight_secret_env: str = "GRPO_WEIGHTS_SECRET"
    """(weight_broadcast_type nccl) Environment variable holding the secret of the trainer's
    weight_broadcast.secret_env (the same value): the server proves it to the trainer, checks the
    trainer's proof and every update's signature. Without it the server refuses to join a trainer
    whose weight_broadcast host is not a loopback address; unset on loopback = unauthenticated."""

    reasoning_parser: str | None = None
    """vLLM reasoning parser name (e.g. "deepseek_r1", "qwen3") for the server's chat-completions route;
    training rollouts keep the model's whole text (reasoning included) as sampled."""

    enable_auto_tool_choice: bool = False
    """Let the model choose tools on the server's OpenAI chat-completions route (needs
    `tool_call_parser`); training rollouts are token-id completions, their tool calls are parsed by the
    orchestrator (orch `tool_call_parser`)."""

    tool_call_parser: str | None = None
    """vLLM tool call parser name for the server's chat-completions route, used with
    enable_auto_tool_choice; training rollouts' tool calls are parsed by orch `tool_call_parser` (give
    it the same name)."""

    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling dict passed to the model config (e.g. {rope_type: yarn, factor: 4.0})."""

    seed: int = 0
    """Engine seed."""

    share_with_group: bool = False
    """Let the owner's group read what the server writes (logs, adapters it is sent) (files 0640, folders 0750); false keeps it to
    the owner alone (0600 / 0700): the run directory holds every prompt and completion, checkpoints
    and the engine's log. Set in one file, it reaches the others."""

    max_num_seqs: int | None = Field(None, gt=0)
    """Sequences the scheduler runs at once; null keeps vLLM's default."""

    max_logprobs: int = Field(20, ge=-1)
    """Most logprobs per position a request may ask for (vLLM's --max-logprobs; -1: the whole
    vocabulary). It must be at least orch consistency_check.top_logprobs when that check is on; a co-located run
    raises it to that."""

    api_key_var: str = "VLLM_API_KEY"
    """Env var holding the API key the server requires on every route but /health (at least 16
    characters, not whitespace only); unset or empty = no key, allowed on a loopback host only."""

    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    """grpo-infer only: restart the vLLM server when it dies or hangs; off by default. A co-located
    run cannot restart its engine (the trainer borrows its weights): it ends and prints the command
    that resumes it."""

    @model_validator(mode="before")
    @classmethod
    def _max_model_len_from_max_seq_len(cls, data: object) -> object:
        return fill_length(data, "max_model_len")

    @field_validator("max_lora_rank")
    @classmethod
    def _rank_is_servable(cls, rank: int | None) -> int | None:
        if rank is not None:
            round_up_lora_rank(rank)
        return rank

    @model_validator(mode="after")
    def _fp8_computes_in_16_bits(self) -> InferenceConfig:
        if self.quantization is not None and self.quantization.startswith("fp8") and "float32" in self.dtype:
            raise ValueError(
                f"quantization {self.quantization} computes in 16 bits, not dtype {self.dtype}: set dtype to "
                "bfloat16 (or float16, or auto)"
            )
        return self

    @model_validator(mode="after")
    def _no_bitsandbytes(self) -> InferenceConfig:
        if self.quantization is not None and self.quantization.lower() in BITSANDBYTES_NAMES:
            raise ValueError(
                f"quantization {self.quantization}: vLLM 0.32 has no bitsandbytes (NF4) method, so nothing serves "
                "or lends NF4 weights; set quantization fp8_per_block (FP8 weights, which a co-located trainer "
                "borrows), or serve unquantized and set qlora_bnb: true in train.yaml (multi-process mode: the "
                "trainer loads its own NF4 base)"
            )
        return self

    @model_validator(mode="after")
    def _collective_needs_one_worker(self) -> InferenceConfig:
        if self.weight_broadcast_type == "nccl" and (self.tp > 1 or self.dp > 1):
            raise ValueError(
                f"weight_broadcast_type nccl joins one worker per server to the trainer's collective, but "
                f"tp {self.tp} x dp {self.dp} runs several: set tp: 1 and dp: 1 (start more servers and list "
                "them in the orchestrator's client.base_url) or use weight_broadcast_type filesystem"
            )
        return self

    @model_validator(mode="after")
    def _merged_needs_exact_dense_weights(self) -> InferenceConfig:
        if self.lora_serving != "merged":
            return self
        if self.tp > 1:
            raise ValueError(
                f"lora_serving merged with tp {self.tp}: merging into tensor-parallel shards is not "
                "implemented; set lora_serving to adapter (or auto), or tp: 1"
            )
        if self.quantization is not None:
            raise ValueError(
                f"lora_serving merged with quantization {self.quantization}: a LoRA delta cannot be added "
                "exactly to quantized base weights; set lora_serving to adapter (or auto), or quantization: null"
            )
        if self.dtype in ("bfloat16", "float16"):
            raise ValueError(
                f"lora_serving merged with dtype {self.dtype}: a 16-bit merged weight drops the LoRA updates "
                "smaller than its rounding step, so the engine would sample an older policy than the one "
                "trained; set dtype: float32 (or auto), or lora_serving: adapter"
            )
        return self

    @model_validator(mode="after")
    def _public_bind_needs_a_key(self) -> InferenceConfig:
        from grpo.utils.auth import open_without_secret

        # Without a key, anyone who reaches the port can load weights or adapters into the engine.
        if open_without_secret(self.bind_host, self.api_key_var):
            raise ValueError(
                f"host {self.host} serves other machines, but ${self.api_key_var} (api_key_var) is unset: "
                f"anyone reaching the port could replace the policy; export {self.api_key_var}=<secret> on "
                "the server and on every client, or bind 127.0.0.1"
            )
        return self

    @property
    def served_lora_rank(self) -> int:
        return round_up_lora_rank(self.max_lora_rank or 64)

    @property
    def bind_host(self) -> str:
        return self.host or "127.0.0.1"
