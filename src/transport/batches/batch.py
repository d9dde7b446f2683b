"""The training batch: what the orchestrator hands the trainer for one step.

The orchestrator packs samples (prompt + completion token ids) into rows of at most `seq_len`
tokens. Per-token arrays are aligned with `input_ids`: entry t describes token t.

- `loss_mask[t]` is True where token t is a model-generated completion token that trains.
- `inference_logprobs[t]` is log p_inference(input_ids[t] | input_ids[:t]) (0 where not masked in).
- `advantages[t]` is the advantage of the sample token t belongs to (0 outside the loss).
- `temperatures[t]` is the sampling temperature that produced token t (1.0 outside the loss);
  the trainer divides the logits predicting token t by it.
- `position_ids[t]` is token t's position in its own sequence (its depth in the row's tree).
- `parent_ids[t]` is the row index of the token that precedes token t in its sequence, -1 where a
  sequence starts. Token t attends to itself and its chain of parents, nothing else, and its
  logprob is predicted from its parent's hidden state. Plain packing puts samples one after
  another (parent t - 1, -1 at each sample start); shared-prefix packing stores a group's common
  prompt once and hangs every completion from its last token, so the rows form a prefix tree
  (docs/design.md, "Shared-prefix packing"). Parents always come before their children.
- `teacher_logprobs[t]` (optional) is the teacher's logprob of token t.
- `routed_experts[t]` (optional, mixture-of-experts models with routing replay) is [num_moe_layers,
  top_k]: the expert ids the inference engine routed token t to in each MoE layer (uint8, uint16
  past 255 experts); `NO_ROUTING` (the dtype's maximum) where none was recorded (the trainer then
  routes that token itself).
- `kept_counts[t]` (optional, int32) is how many tokens the engine's sampler kept (after top_k,
  top_p, min_p) when it sampled token t, as a grpo CPU engine reports it; 0 where it reported none
  (prompt tokens, tokens of another engine). The trainer then keeps exactly that many of its own
  most likely tokens there (grpo.trainer.sampling_truncation).
- `images` (optional, vision-language rows) holds the processed pixels of the images whose
  placeholder tokens lie in the row and where each placeholder run starts
  (grpo.transport.batches.images).

A batch also says how its completions were truncated (`sampling`: top_k, top_p, min_p, the same for
every row), because vLLM reports logprobs under the truncated distribution and the trainer must
compute its own under the same truncation (grpo.trainer.sampling_truncation).

The trainer predicts token t from the logits at its parent, so the first token of every sequence
never carries loss (it is a prompt token anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from grpo.transport.batches.images import RowImages
from grpo.transport.batches.probe import ConsistencyProbe

# name -> dtype of every per-token array in a row; the wire format and validation use this table.
ROW_FIELDS: dict[str, type] = {
    "input_ids": np.int32,
    "position_ids": np.int32,
    "loss_mask": np.bool_,
    "advantages": np.float32,
    "inference_logprobs": np.float32,
    "temperatures": np.float32,
    "parent_ids": np.int32,
}
OPTIONAL_ROW_FIELDS: dict[str, type] = {"teacher_logprobs": np.float32}
ROUTING_DTYPES: tuple[np.dtype, np.dtype] = (np.dtype(np.uint8), np.dtype(np.uint16))
"""Dtypes of `routed_experts` ([num_tokens, num_moe_layers, top_k], not in the 1-D tables above)."""

KEPT_COUNTS_DTYPE: np.dtype = np.dtype(np.int32)
"""Dtype of `kept_counts` (kept apart from OPTIONAL_ROW_FIELDS, whose entries are float columns)."""

EngineSampler = Literal["cpu", "cuda_v2", "cuda_v1"]
"""vLLM's sampler, by the engine's device and model runner: `cpu` (the CPU engine: min_p on
probabilities, PyTorch's top_k/top_p), `cuda_v2` (Model Runner V2, vLLM's default on CUDA: min_p on
logits and the Triton top_k/top_p kernels), `cuda_v1` (VLLM_USE_V2_MODEL_RUNNER=0 on CUDA: min_p on
probabilities, the Triton top_k/top_p kernels)."""
ENGINE_SAMPLERS: tuple[EngineSampler, ...] = ("cpu", "cuda_v2", "cuda_v1")


def routing_dtype(num_experts: int) -> np.dtype:
    """The smallest routing dtype whose maximum (kept for NO_ROUTING) is no expert id."""
    return ROUTING_DTYPES[0] if num_experts < 255 else ROUTING_DTYPES[1]


def no_routing(dtype: np.dtype) -> int:
    """The `routed_experts` entry that means "not recorded"."""
    return int(np.iinfo(dtype).max)


def compact_routing(engine_routing: np.ndarray, num_tokens: int) -> np.ndarray:
    """The engine's [num_tokens - 1 (or fewer), layers, top_k] routing as `routed_experts`: the
    smallest routing dtype, one entry per token, NO_ROUTING for the tokens it has none for (the last
    sampled token, which no forward pass saw)."""
    if engine_routing.shape[0] > num_tokens or (engine_routing.size and engine_routing.min() < 0):
        raise ValueError(
            f"engine routing has {engine_routing.shape[0]} tokens for a sequence of {num_tokens} "
            "or negative expert ids"
        )
    dtype = routing_dtype(int(engine_routing.max()) + 1 if engine_routing.size else 0)
    out = np.full((num_tokens, *engine_routing.shape[1:]), no_routing(dtype), dtype=dtype)
    out[: engine_routing.shape[0]] = engine_routing
    return out


@dataclass
class PackedRow:
    """One packed sequence of several samples; every array has shape [num_tokens]."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    temperatures: np.ndarray
    parent_ids: np.ndarray
    teacher_logprobs: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    """[num_tokens, num_moe_layers, top_k] expert ids for routing replay (see the module doc)."""
    kept_counts: np.ndarray | None = None
    """[num_tokens] int32 kept-set sizes the engine reported, 0 where none (see the module doc)."""
    images: RowImages | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_loss_samples(self) -> int:
        """Samples with at least one loss token. A sample's loss tokens form one chain of only
        children (in a prefix tree only loss-free tokens are shared), so these are the chains that
        hold a loss token: the trainer's `sequence_segments`, counted in numpy."""
        n = self.num_tokens
        parents = self.parent_ids
        num_children = np.bincount(parents[parents >= 0], minlength=n)
        continues: np.ndarray = np.zeros(n, np.bool_)
        continues[1:] = (parents[1:] == np.arange(n - 1)) & (num_children[:-1] == 1)
        segments = np.cumsum(~continues)
        return int(np.unique(segments[self.loss_mask]).shape[0])

    def sequence_lengths(self) -> list[int]:
        """Token count of every sequence ending in this row (one per leaf of its tree), as it
        would be unshared: a sequence's length is its last token's position + 1."""
        has_child: np.ndarray = np.zeros(self.num_tokens, np.bool_)
        has_child[self.parent_ids[self.parent_ids >= 0]] = True
        return (self.position_ids[~has_child] + 1).tolist()

    def validate(self) -> None:
        """Raise ValueError if arrays disagree in length or dtype, the tree is malformed, or a loss
        token starts a sequence."""
        n = self.num_tokens
        for name, dtype in {**ROW_FIELDS, **OPTIONAL_ROW_FIELDS}.items():
            arr = getattr(self, name)
            if arr is None:
                continue
            if arr.ndim != 1 or arr.shape[0] != n:
                raise ValueError(f"row field {name} has shape {arr.shape}, expected ({n},)")
            if arr.dtype != np.dtype(dtype):
                raise ValueError(f"row field {name} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
        routing = self.routed_experts
        if routing is not None:
            if routing.ndim != 3 or routing.shape[0] != n:
                raise ValueError(
                    f"row routed_experts has shape {routing.shape}, expected ({n}, layers, top_k)"
                )
            if routing.dtype not in ROUTING_DTYPES:
                raise ValueError(f"row routed_experts has dtype {routing.dtype}, expected uint8 or uint16")
        counts = self.kept_counts
        if counts is not None and (
            counts.ndim != 1 or counts.shape[0] != n or counts.dtype != KEPT_COUNTS_DTYPE
        ):
            raise ValueError(
                f"row kept_counts has shape {counts.shape} and dtype {counts.dtype}, expected ({n},) int32"
            )
        check_tree(self.parent_ids, self.position_ids)
        if self.images is not None:
            self.images.validate(n)
        if np.any(self.loss_mask & (self.parent_ids < 0)):
            # Nothing predicts a sequence's first token (a prompt always precedes a completion).
            raise ValueError("row loss_mask is set on a sequence's first token, which no token predicts")


def plain_parent_ids(position_ids: np.ndarray) -> np.ndarray:
    """parent_ids of samples packed one after another ([N] position ids restarting at 0 per sample)."""
    parents: np.ndarray = np.arange(-1, position_ids.shape[0] - 1, dtype=np.int32)
    parents[position_ids == 0] = -1
    return parents


def concat_parent_ids(parent_ids: list[np.ndarray]) -> np.ndarray:
    """parent_ids of consecutive token runs (each indexed from its own start) as one array indexed
    from the start of the first run."""
    offsets = np.cumsum([0] + [p.shape[0] for p in parent_ids[:-1]])
    shifted = [np.where(p < 0, -1, p + off) for p, off in zip(parent_ids, offsets, strict=True)]
    return np.concatenate(shifted).astype(np.int32)


def check_tree(parent_ids: np.ndarray, position_ids: np.ndarray) -> None:
    """Raise ValueError unless every parent comes before its child and each child sits one position
    deeper (sequence starts at position 0): the attention mask and the logprob alignment rely on it."""
    index = np.arange(parent_ids.shape[0])
    roots = parent_ids < 0
    if np.any(parent_ids[~roots] >= index[~roots]) or np.any(parent_ids < -1):
        raise ValueError("row parent_ids must be -1 or the index of an earlier token")
    depth = np.where(roots, 0, position_ids[np.maximum(parent_ids, 0)] + 1)
    if not np.array_equal(depth, position_ids):
        raise ValueError(
            "row position_ids must be 0 at a sequence start and the parent's position + 1 elsewhere"
        )


@dataclass(frozen=True)
class SamplingTruncation:
    """The sampling processors after temperature that vLLM applied to every completion of a batch;
    the defaults turn each off."""

    top_k: int = 0
    """Keep the top_k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all)."""
    min_p: float = 0.0
    """Keep tokens at least min_p times as likely as the most likely one (0.0: all)."""
    engine_sampler: EngineSampler = "cpu"
    """Whose boundary and tie rules the trainer follows: those of the sampler of the engine that
    sampled (grpo.trainer.cuda_sampling_truncation). Not on the wire: the orchestrator does not
    know the engine's device, the trainer sets it from its own (a co-located engine shares it)."""

    @property
    def is_active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def validate(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p must be a float in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, float) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling min_p must be a float in [0, 1], got {self.min_p!r}")
        if self.engine_sampler not in ENGINE_SAMPLERS:
            raise ValueError(
                f"sampling engine_sampler must be one of {ENGINE_SAMPLERS}, got {self.engine_sampler!r}"
            )


@dataclass
class TrainingBatch:
    """Everything the trainer needs for one optimizer step."""

    step: int
    """Batch index n: rollouts from policies >= n - max_async_level; training on it produces
    policy n + 1 (docs/design.md, "Step semantics")."""

    rows: list[PackedRow]
    metadata: dict[str, float | int | str] = field(default_factory=dict)
    """Orchestrator-side numbers worth logging next to trainer metrics (not used for training)."""
    sampling: SamplingTruncation = field(default_factory=SamplingTruncation)
    """How the completions' distributions were truncated after temperature (see the module doc)."""
    consistency_probe: ConsistencyProbe | None = None
    """At orch consistency_check steps: the engine's distributions at a few positions, for the
    trainer to compare with its own (grpo.transport.batches.probe)."""

    @property
    def num_loss_tokens(self) -> int:
        """Loss normaliser: loss tokens over the whole step (all rows, all ranks)."""
        return sum(r.num_loss_tokens for r in self.rows)

    @property
    def num_loss_samples(self) -> int:
        """Per-sample loss normaliser (sequence ratio types): samples with a loss token, all rows."""
        return sum(r.num_loss_samples for r in self.rows)

    def validate(self) -> None:
        if self.step < 0:
            raise ValueError(f"batch step must be >= 0, got {self.step}")
        self.sampling.validate()
        for row in self.rows:
            row.validate()
        if self.consistency_probe is not None:
            self.consistency_probe.validate()
