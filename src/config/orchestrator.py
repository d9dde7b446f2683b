"""`orch.yaml`: the orchestrator (`grpo-orch`, or the main loop of `grpo`).

Its `sampling` section is in grpo.config.sections.sampling, `env` entries in grpo.config.sections.env (and
grpo.config.sections.dataset_env), `advantage` in grpo.config.sections.advantage, the transports in
grpo.config.sections.transport, `client` in grpo.config.sections.client (each re-exported here).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo.config.across_files.max_seq_len import fill_length
from grpo.config.base import StrictModel
from grpo.config.sections.advantage import GROUP_RELATIVE_ADVANTAGES as GROUP_RELATIVE_ADVANTAGES
from grpo.config.sections.advantage import AdvantageConfig as AdvantageConfig
from grpo.config.sections.client import ClientConfig as ClientConfig
from grpo.config.sections.client import ElasticConfig as ElasticConfig
from grpo.config.sections.client import TeacherClientConfig
from grpo.config.sections.consistency import ConsistencyCheckConfig
from grpo.config.sections.dataset_env import DatasetEnvConfig
from grpo.config.sections.env import OPENENV_PREFIX as OPENENV_PREFIX
from grpo.config.sections.env import EnvBlock as EnvBlock
from grpo.config.sections.env import EnvConfig as EnvConfig
from grpo.config.sections.sampling import SamplingConfig
from grpo.config.sections.sampling import TempSchedulerConfig as TempSchedulerConfig
from grpo.config.sections.streaming import StreamingConfig, streaming_advantage_problem
from grpo.config.sections.transport import (
    FilesystemRolloutTransport,
    FilesystemWeightBroadcast,
    RolloutTransportConfig,
    WeightBroadcastConfig,
)
from grpo.config.sections.transport import NcclWeightBroadcast as NcclWeightBroadcast
from grpo.config.sections.transport import ZmqRolloutTransport as ZmqRolloutTransport


class ModelConfig(StrictModel):
    name: str | None = None
    """HuggingFace model id or local path of the policy being trained (tokenizer and chat template)."""

    lora_adapter: str | None = "default"
    """Name under which the inference server serves the policy's LoRA adapter; null trains
    full weights (requests use the base model name)."""

    lora_rank: int | None = Field(None, gt=0)
    """LoRA rank of the trainer (checked against the trainer and the server's max_lora_rank)."""

    lora_alpha: float | None = Field(None, gt=0)
    """LoRA alpha of the trainer (checked against the trainer)."""


class BufferConfig(StrictModel):
    seed: int | None = None
    """Seed for example sampling (null = the run seed)."""

    online_difficulty_filtering: bool = False
    """Drop groups whose rollouts all scored 0.0 or all 1.0 (no learning signal)."""

    easy_threshold: float | None = None
    """Mean group reward above which an example moves to the easy pool."""

    hard_threshold: float | None = None
    """Mean group reward below which an example moves to the hard pool."""

    easy_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of easy examples promoted back to the normal pool on start."""

    hard_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of hard examples promoted back to the normal pool on start."""

    hash_keys: list[str] = Field(default_factory=lambda: ["task", "prompt"])
    """Example fields hashed to identify (and deduplicate) an example (a prompt's images by their pixels)."""

    skip_verification: bool = False
    """Skip reward scoring (rewards are 0); for pure distillation. Refused with
    online_difficulty_filtering, which would drop every group."""

    env_ratios: list[float] | None = None
    """Sampling weight per environment (same order as env[]); must sum to > 0."""

    @model_validator(mode="after")
    def _ratios_positive(self) -> BufferConfig:
        ratios = self.env_ratios
        if ratios is not None and (any(r < 0 for r in ratios) or sum(ratios) <= 0):
            raise ValueError("buffer.env_ratios must be non-negative and sum to > 0")
        if self.skip_verification and self.online_difficulty_filtering:
            raise ValueError(
                "buffer.skip_verification gives every rollout reward 0, so online_difficulty_filtering "
                "would drop every group and no batch would ever fill; set online_difficulty_filtering: false"
            )
        return self


class GibberishFilterConfig(StrictModel):
    type: Literal["gibberish"]
    enforce: bool = False
    """Mask flagged rollouts from the loss (otherwise only count them)."""

    token_id_threshold: int = 100000
    """Token ids at or above this are gibberish candidates."""

    logprob_offset: float = 2.0
    """A candidate is flagged when its logprob is below log(1/vocab) + offset."""


class RepetitionFilterConfig(StrictModel):
    type: Literal["repetition"]
    enforce: bool = False
    """Mask flagged rollouts from the loss (otherwise only count them)."""

    window: int = Field(3000, ge=1)
    """Consecutive high-probability tokens before a rollout is flagged."""

    prob_threshold: float = Field(0.99, gt=0.0, le=1.0)
    """Per-token probability counted as high."""


FilterConfig = Annotated[GibberishFilterConfig | RepetitionFilterConfig, Field(discriminator="type")]


class CheckpointConfig(StrictModel):
    interval: int | None = Field(None, gt=0)
    """Save progress and buffer every N steps (null = never)."""

    resume_step: int | None = Field(None, ge=-1)
    """Step to resume from; -1 = the latest checkpoint."""

    wait_for_weights_timeout: float | None = Field(None, gt=0)
    """Seconds to wait for the resumed step's weights to appear, and for the final policy before its
    evaluation (null: client.timeout)."""

    keep_last: int | None = Field(None, gt=0)
    """Keep at most the N newest checkpoints."""

    keep_interval: int | None = Field(None, gt=0)
    """Never delete checkpoints at multiples of N."""

    skip_progress: bool = False
    """On resume, do not restore the step counter and progress."""

    skip_buffer: bool = False
    """On resume, do not restore the buffer."""


class EvalConfig(StrictModel):
    env: list[EnvBlock]
    """Environments to evaluate on (blocks as in env)."""

    @field_validator("env")
    @classmethod
    def _at_least_one_env(cls, env: list[EnvBlock]) -> list[EnvBlock]:
        if not env:
            raise ValueError("needs at least one environment; to turn evaluation off, remove eval")
        return env

    num_examples: int = Field(-1, ge=-1)
    """Examples per environment (-1 = all)."""

    rollouts_per_example: int = Field(1, ge=1)
    """Rollouts per example (evaluation trains nothing, so one each measures the reward; more give
    pass@k-style spread)."""

    interval: int = Field(100, gt=0)
    """Evaluate every N training steps, and once more on the final policy (max_steps) after the last batch."""

    eval_base_model: bool = True
    """Also evaluate the base model (step 0)."""

    skip_eval_on_resume: bool = True
    """Skip the evaluation that would run right after resuming."""

    cancel_inflight_rollouts_on_eval: bool = False
    """Cancel in-flight training rollouts before evaluating."""


class ReportConfig(StrictModel):
    project: str = "grpo"
    """W&B project."""

    name: str | None = None
    """W&B run name."""

    offline: bool = False
    """Run W&B offline (no network needed)."""

    samples: bool | None = None
    """Log a table of prompt/completion samples every `interval` steps (null = on; false = off)."""

    distributions: bool | None = None
    """Log reward, advantage and completion-length histograms every `interval` steps (null = on)."""

    interval: int = Field(10, gt=0)
    """Steps between sample/distribution logs."""

    trainer_rows_wait_s: float = Field(60.0, ge=0)
    """(trainer in its own process) Seconds the orchestrator, after sending the last batch, waits
    for the trainer's row of that step in trainer_metrics.jsonl before closing the W&B run (it is
    the run's one writer); a row that comes later is only in the file."""


class RolloutLogConfig(StrictModel):
    """Each step's rollouts on disk, without W&B: RUN_DIR/rollouts/step_N.jsonl.gz (docs/metrics.md)."""

    enabled: bool = True
    """Write each step's rollouts to RUN_DIR/rollouts/step_N.jsonl.gz (false: no rollouts folder)."""

    max_rollouts_per_step: int = Field(64, ge=1)
    """Rollouts kept per step (the first ones of the step's batch)."""

    max_total_mib: float = Field(64.0, gt=0)
    """Stop writing once the rollouts folder holds this many MiB (one line in the log says so)."""


class TeacherModelConfig(StrictModel):
    model: ModelConfig
    """The teacher model (name); its logprobs of each rollout go to the trainer."""

    client: TeacherClientConfig | None = None
    """An already running teacher server; null = the policy's servers serve the teacher model."""

    @model_validator(mode="after")
    def _needs_name(self) -> TeacherModelConfig:
        if not self.model.name:
            raise ValueError(
                "teacher_model.model.name is required: the model id the teacher server serves "
                "(e.g. teacher_model: {model: {name: Qwen/Qwen3-8B}})"
            )
        return self


def _default_env() -> list[EnvConfig | DatasetEnvConfig]:
    return [EnvConfig(id="reverse-text")]


class OrchestratorConfig(StrictModel):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""

    env: list[EnvBlock] = Field(default_factory=lambda: _default_env(), min_length=1)
    """Training environments: each a block with `id` (built-in, import path, or a server at `address`)
    or with `dataset` (a dataset scored by TRL-style reward functions; the (dataset block) keys)."""

    reward_threads: int = Field(8, gt=0)
    """Worker threads shared by every sync reward function of the orchestrator (async ones run on its
    event loop). A reward stuck past its timeout keeps its thread; raise this for many slow,
    I/O-bound sync rewards."""

    batch_size: int = Field(128, gt=0)
    """Rollouts per training step. Unset in a co-located run on CPU: 8 groups of rollouts_per_example
    (at most 64 rollouts, at least one group; grpo.config.machine.cpu_defaults)."""

    rollouts_per_example: int = Field(8, gt=0)
    """Rollouts per prompt: the group each rollout's advantage is measured against (batch_size must be
    a multiple). 1 learns only with advantage.type reinforce_pp (a batch-wide baseline); with a
    group-relative advantage it is refused."""

    seq_len: int = Field(2048, gt=0)
    """Tokens per packed training row; longer samples are truncated. Unset: max_seq_len where set,
    else in a co-located run whose train.yaml sets sequence_len that value."""

    max_seq_len: int | None = Field(None, gt=0)
    """Longest sequence, prompt + completion: seq_len, train sequence_len, infer max_model_len default to
    it. One key for the three files (grpo.config.across_files.max_seq_len); sampling.max_tokens must leave room
    for the prompt in it."""

    micro_batch_tokens: int | None = Field(None, gt=0)
    """Tokens per packed training row (the trainer's micro-batch budget, train.yaml's
    micro_batch_tokens): a group's prefix tree stays whole in one row whenever it fits, so its
    shared prompt is encoded once; samples are still cut at seq_len. null: seq_len (a co-located
    run sets it from the memory plan)."""

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the chat template on every render of every environment's
    conversations, e.g. {enable_thinking: false} for Qwen3 (as vLLM's chat_template_kwargs)."""

    tool_call_parser: str | None = None
    """How the model's tool calls are read from its replies (for env blocks with `tools`): null uses
    the tokenizer's own response parsing when its tokenizer config has a `response_template`
    (transformers' parse_response), else vLLM's `hermes` parser (`<tool_call>{json}</tool_call>`:
    Qwen2.5, Qwen3, Hermes); a name picks that vLLM tool parser (the names of vLLM's
    --tool-call-parser, e.g. llama3_json, mistral, qwen3_coder). infer.yaml's tool_call_parser does
    not reach training rollouts (they are token-id completions): set the same name here."""

    shared_prefix: bool = True
    """Store the prompt a group's rollouts share once per training row (a prefix tree; the trainer
    attends along each rollout's own tokens), so its forward and backward run once, not once per
    rollout. Exact: the loss and gradient are those of unshared rows. false packs every rollout whole."""

    max_steps: int | None = Field(None, gt=0)
    """Training steps (null = run until stopped)."""

    max_async_level: int = Field(1, ge=0)
    """How far inference may run ahead of the trainer: rollouts for batch n are started from policy
    max(0, n - max_async_level) or newer; 0 samples every batch from the newest policy. A co-located
    run on CPU takes 0 where neither this nor train.yaml sets it: generation and training share the
    cores there, so the overlap 1 allows saves little time and the lag costs steps (docs/loss.md)."""

    max_off_policy_steps: int = Field(8, ge=0)
    """Oldest policy a batch trains on: batch n drops (and counts in off_policy/num_dropped) a
    rollout started from a policy older than n - max_off_policy_steps. Rollouts that finish late
    (long, multi-turn, or oversampled leftovers) train in a later batch until then. At least
    max_async_level; strictly on-policy training is both 0."""

    partial_rollouts: bool = False
    """Continue a rollout that is still generating when a new policy reaches inference under that
    policy instead of finishing it on the old one: generation streams, stops at the update (vLLM
    aborts the request), keeps its tokens and their logprobs, and resumes from them (token in, the
    remaining max_tokens) once the servers run the new policy. Each token trains with the logprob of
    the policy that sampled it, and max_off_policy_steps judges a rollout by its oldest token. Metrics
    partial/num_resumed_rollouts and partial/num_recovered_tokens. Evaluation rollouts never resume."""

    oversampling_factor: float = Field(1.0, ge=1.0)
    """Groups launched as a multiple of the groups still needed: this batch's missing ones plus those of
    every later batch the current policy may serve (max_async_level). Groups in flight and finished ones
    no batch has taken count against it, and at most batch_size * oversampling_factor rollouts are in
    flight. A batch takes the freshest finished groups first, so the surplus hides slow generations and
    stands in for filtered groups; what a batch leaves may go stale and be dropped (with a trainer
    slower than generation, about (factor - 1) / factor of all groups). 1.0 launches exactly what the
    batches need."""

    output_dir: str = "outputs/run_default"
    """Run directory: rollouts, broadcasts, checkpoints, metrics.jsonl, resolved configs."""

    share_with_group: bool = False
    """Let the owner's group read what the run writes (files 0640, folders 0750); false keeps it to
    the owner alone (0600 / 0700): the run directory holds every prompt and completion, checkpoints
    and the engine's log. Set in one file, it reaches the others."""

    seed: int = 42
    """Random seed."""

    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How completions are sampled. Every completion request (training, evaluation, every turn,
    every resumed partial rollout) states every setting below, so no server default applies (grpo's
    vLLM servers also run with --generation-config vllm, ignoring the checkpoint's
    generation_config.json); `--dry-run` prints what each request carries. The trainer reproduces
    the temperature and the top_k/top_p/min_p truncation, so every penalty accepts only its off
    value."""
    client: ClientConfig = Field(default_factory=ClientConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    filters: list[FilterConfig] = Field(default_factory=list)
    """Rollout quality filters."""

    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig | None = None
    """Online evaluation (null = none)."""

    report_to: ReportConfig | None = None
    """W&B reporting (null = none; metrics.jsonl is always written): the run's one W&B run, with the
    trainer's metrics under `trainer/`, its id kept in the run dir's `wandb_id` so that a restart
    resumes it (docs/metrics.md)."""

    rollout_log: RolloutLogConfig = Field(default_factory=RolloutLogConfig)
    """Each step's rollouts (prompt, completion, rewards, advantage) under RUN_DIR/rollouts/."""

    rollout_transport: RolloutTransportConfig = Field(default_factory=FilesystemRolloutTransport)
    """How batches reach the trainer."""

    weight_broadcast: WeightBroadcastConfig = Field(default_factory=FilesystemWeightBroadcast)
    """How new weights reach the inference servers."""

    teacher_model: TeacherModelConfig | None = None
    """Teacher for on-policy distillation (null = none)."""

    streaming: StreamingConfig = Field(default_factory=StreamingConfig)
    """Streaming micro-batches: the trainer trains on a step's groups as they finish."""

    consistency_check: ConsistencyCheckConfig = Field(default_factory=ConsistencyCheckConfig)
    """The engine's whole next-token distribution against the trainer's, every few steps (off by default)."""

    @model_validator(mode="before")
    @classmethod
    def _seq_len_from_max_seq_len(cls, data: object) -> object:
        return fill_length(data, "seq_len")

    @model_validator(mode="after")
    def _streaming_is_exact(self) -> OrchestratorConfig:
        problem = streaming_advantage_problem(self.streaming.groups_per_part, self.advantage.type)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _stop_strings_see_whole_completions(self) -> OrchestratorConfig:
        # vLLM matches stop strings in the text of one request; a resumed request starts from the
        # tokens kept without their text, so a stop string across the seam would go unnoticed.
        if self.partial_rollouts and self.sampling.stop:
            raise ValueError(
                "sampling.stop with partial_rollouts: a resumed request never sees the text it kept, so a "
                "stop string across an update would be missed; set partial_rollouts: false or remove sampling.stop"
            )
        return self

    @model_validator(mode="after")
    def _groups_can_learn(self) -> OrchestratorConfig:
        if self.rollouts_per_example == 1 and self.advantage.type in GROUP_RELATIVE_ADVANTAGES:
            raise ValueError(
                f"rollouts_per_example 1 with advantage.type {self.advantage.type}: each rollout is compared "
                "with the others of its prompt, so every advantage is 0 and nothing is learned; set "
                "rollouts_per_example: 8 (batch_size a multiple of it), or advantage: {type: reinforce_pp}"
            )
        return self

    @model_validator(mode="after")
    def _groups_fill_batch(self) -> OrchestratorConfig:
        if self.batch_size % self.rollouts_per_example != 0:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be divisible by rollouts_per_example "
                f"({self.rollouts_per_example}): each step trains on whole groups"
            )
        if self.buffer.env_ratios is not None and len(self.buffer.env_ratios) != len(self.env):
            raise ValueError(
                f"buffer.env_ratios has {len(self.buffer.env_ratios)} entries but env has {len(self.env)}"
            )
        if self.max_off_policy_steps < self.max_async_level:
            raise ValueError(
                f"max_off_policy_steps ({self.max_off_policy_steps}) is below max_async_level "
                f"({self.max_async_level}): rollouts started for the batches inference may run ahead to "
                f"would be too old to train when they arrive; set max_off_policy_steps >= {self.max_async_level}"
            )
        return self

    @model_validator(mode="after")
    def _collective_has_every_server(self) -> OrchestratorConfig:
        wb = self.weight_broadcast
        if wb.type != "nccl":
            return self
        if self.client.elastic is not None:
            raise ValueError(
                "weight_broadcast type nccl sends to a fixed group of servers, but client.elastic makes the pool "
                "change; use weight_broadcast type filesystem (in orch.yaml and train.yaml) with an elastic pool"
            )
        num_urls = len(self.client.base_url)
        if wb.num_servers != num_urls:
            raise ValueError(
                f"weight_broadcast.num_servers is {wb.num_servers} but client.base_url lists {num_urls} server(s), "
                f"and the trainer waits for num_servers of them: set num_servers: {num_urls} in orch.yaml and train.yaml"
            )
        return self

    @model_validator(mode="after")
    def _row_holds_a_sample(self) -> OrchestratorConfig:
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < self.seq_len:
            raise ValueError(
                f"micro_batch_tokens ({self.micro_batch_tokens}) is below seq_len ({self.seq_len}): a row must "
                f"hold a whole sample; set micro_batch_tokens >= {self.seq_len} (or leave it unset)"
            )
        return self

    @property
    def row_tokens(self) -> int:
        """Most tokens of one packed row: micro_batch_tokens, else seq_len."""
        return self.micro_batch_tokens if self.micro_batch_tokens is not None else self.seq_len

    @property
    def num_groups_per_step(self) -> int:
        return self.batch_size // self.rollouts_per_example

    @property
    def num_parts_per_step(self) -> int:
        """Batches (parts) each step reaches the trainer in: 1 unless streaming."""
        return self.streaming.num_parts(self.num_groups_per_step)
