"""Trainer-side packing: PackedRows -> model inputs with attention along each token's parent chain.

The rows of one micro-batch are concatenated into a single [T] token stream. Every token attends to
itself and its ancestors (grpo.transport.batches.batch: `parent_ids`), which is causal attention within a
sample for plain rows and prefix-tree attention for shared-prefix rows.

With flash-attention (CUDA) and plain rows, transformers derives the varlen boundaries from
position_ids itself, so the whole micro-batch is one [1, T] forward and no mask is built. Otherwise
(sdpa/eager, CPU, or prefix trees) the micro-batch is cut into its independent pieces (a sample, or
a prefix tree: tokens that share a root) and these run as padded batches [B, L] with one
[L, L] mask each (`Forward`). Attention then costs the sum of the pieces' squared lengths: a
2048-token row holding 32 samples of 64 tokens costs 32 x 64^2 instead of 2048^2 (32x less), and
the attention kernel never spends time on blocks the mask would throw away.

Only loss tokens need logprobs in a training step, so the batch also lists them (`LossTokens`):
each one's target id and the index of the token whose hidden state predicts it (its parent).
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from grpo.trainer.tree_split import Piece, cut_at_trunks, piece_parents
from grpo.transport.batches.batch import PackedRow, concat_parent_ids

if TYPE_CHECKING:
    import torch

    from grpo.trainer.vision_inputs import VisionInputs, VisionTokens

T = TypeVar("T")
P = TypeVar("P", bound=Sized)


@dataclass
class LossTokens:
    """The loss tokens of a micro-batch, in order; every tensor is [L]."""

    positions: torch.Tensor
    """Index of each loss token in the micro-batch."""
    predicted_from: torch.Tensor
    """Index into the micro-batch of the token whose hidden state predicts this one (its parent)."""
    targets: torch.Tensor
    temperatures: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    sequence_ids: torch.Tensor
    """Which sequence each loss token belongs to (for the per-sequence masks and ratios)."""
    teacher_logprobs: torch.Tensor | None
    kept_counts: torch.Tensor | None = None
    """The engine's kept-set size at each loss token (0: none reported), when a row carries them."""


@dataclass
class Forward:
    """One padded decoder call over B independent pieces of at most L tokens."""

    input_ids: torch.Tensor
    """[B, L]; padding is token 0."""
    position_ids: torch.Tensor
    """[B, L]; padding is position 0."""
    attention_mask: torch.Tensor
    """[B, 1, L, L] bool, True = may attend; a padding query attends only to itself, so no softmax row
    is empty (an all-masked row would be NaN, and 0 * NaN would reach the real tokens' gradients).
    The HF backend turns it into the masks its decoder takes (grpo.trainer.hf.attention: the form of
    its attention implementation, a window for sliding layers)."""
    slots: torch.Tensor
    """[n] flat index into the B * L outputs of each micro-batch token this call computes."""
    tokens: torch.Tensor
    """[n] micro-batch index of each of those tokens."""


@dataclass
class RowExtent:
    """One packed row of a micro-batch: the next `num_tokens` tokens after the rows before it."""

    num_tokens: int
    num_loss_tokens: int
    num_loss_samples: int
    """Samples with a loss token (PackedRow.num_loss_samples)."""


@dataclass
class MicroBatch:
    """Model inputs and per-token training data of one micro-batch; token tensors are [T]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent_ids: torch.Tensor
    """Micro-batch index of each token's parent, -1 where a sequence starts."""
    forwards: list[Forward] | None
    """Padded decoder calls that together compute every token; None when the attention kernel
    separates samples by position_ids (one [1, T] forward for the whole micro-batch)."""
    temperatures: torch.Tensor
    loss: LossTokens
    num_sequence_tokens: int
    """Tokens of the sequences as plain packing would store them (a shared prefix once per sequence)."""
    routed_experts: torch.Tensor | None = None
    """[T, num_layers, top_k] int16 expert ids to replay (-1: none recorded; int16 keeps a long batch's
    routing small on the device), or None (routing replay off)."""
    vision: VisionInputs | None = None
    """Image inputs of a vision-language micro-batch (grpo.trainer.vision_inputs); None without images."""
    rows: list[RowExtent] = field(default_factory=list)
    """Its packed rows, in order (the router load-balancing loss is computed per row)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def sequence_segments(parent_ids: torch.Tensor) -> torch.Tensor:
    """[T] parent indices -> [T] segment index: maximal chains in which each token is the only child
    of the one before it. A branch point ends a segment, so a token's ancestors are whole segments
    (plus the earlier part of its own); in plain rows a segment is a sample, in a prefix tree the
    shared prompt is one segment and every completion another."""
    import torch

    num_tokens = parent_ids.shape[0]
    num_children = torch.bincount(parent_ids[parent_ids >= 0], minlength=num_tokens)
    previous_has_one_child = torch.cat([num_children.new_zeros(1), num_children[:-1]]) == 1
    continues = (
        parent_ids == torch.arange(-1, num_tokens - 1, device=parent_ids.device)
    ) & previous_has_one_child
    return torch.cumsum((~continues).long(), 0) - 1


def tree_attention_mask(parent_ids: torch.Tensor) -> torch.Tensor:
    """[T] parent indices of one row -> [1, 1, T, T] bool mask: token i may attend token j iff j is i
    or one of its ancestors."""
    import torch

    device = parent_ids.device
    segments = sequence_segments(parent_ids)
    num_segments = int(segments[-1]) + 1
    first_token = torch.zeros(num_segments, dtype=torch.long, device=device).scatter_reduce(
        0, segments, torch.arange(parent_ids.shape[0], device=device), "amin", include_self=False
    )
    parent_token = parent_ids[first_token]
    # ancestors[s, a]: segment a is s or an ancestor of s. Parents come first, so one pass suffices.
    ancestors = torch.eye(num_segments, dtype=torch.bool, device=device)
    for seg, parent in enumerate(parent_token.tolist()):
        if parent >= 0:
            ancestors[seg] |= ancestors[int(segments[parent])]
    causal = torch.ones(parent_ids.shape[0], parent_ids.shape[0], dtype=torch.bool, device=device).tril()
    return (ancestors[segments][:, segments] & causal)[None, None]


def _is_plain(row: PackedRow) -> bool:
    return bool(
        np.all(row.parent_ids[1:] == np.where(row.position_ids[1:] == 0, -1, np.arange(row.num_tokens - 1)))
    )


def build_micro_batch(
    rows: list[PackedRow],
    device: torch.device,
    varlen_attention: bool,
    one_forward: bool = False,
    vision: VisionTokens | None = None,
    pair_weight: float = 0.0,
) -> MicroBatch:
    """Concatenate `rows` into one packed sequence on `device`. `one_forward` puts all its pieces in
    a single padded decoder call: under FSDP every rank must make the same number of calls (each
    gathers the layers' shards collectively), and the ranks' pieces differ. `vision`: the model's
    image token and merge size, for rows that carry images. `pair_weight` > 0 cuts wide prefix trees
    at their trunks (grpo.trainer.tree_split); rows with images or routing are never cut (a trunk
    copy would lack its image embeddings or replayed experts)."""
    import torch

    from grpo.trainer.vision_inputs import build_vision_inputs

    assert rows, "a micro-batch needs at least one row"

    def cat(name: str, dtype: torch.dtype) -> torch.Tensor:
        arrays = [getattr(r, name) for r in rows]
        return torch.from_numpy(np.concatenate(arrays)).to(device=device, dtype=dtype)

    for row in rows:
        # Otherwise the row's first tokens would attend into the previous row of the micro-batch.
        if row.num_tokens == 0 or int(row.parent_ids[0]) != -1 or int(row.position_ids[0]) != 0:
            raise ValueError("every packed row must be non-empty and start a sequence (position_ids[0] == 0)")
        row.validate()
    has_routing = [r.routed_experts is not None for r in rows]
    if any(has_routing) and not all(has_routing):
        raise ValueError("some rows of the batch carry routed_experts and some do not")
    has_teacher = [r.teacher_logprobs is not None for r in rows]
    if any(has_teacher) and not all(has_teacher):
        raise ValueError("some rows of the batch carry teacher_logprobs and some do not")
    has_images = any(r.images is not None for r in rows)
    if has_images and vision is None:
        raise ValueError("rows carry images but the trainer's model is text-only")
    parents = concat_parent_ids([r.parent_ids for r in rows])
    parent_ids = torch.from_numpy(parents).to(device=device, dtype=torch.long)
    forwards = None
    # Image rows take the padded path: their M-RoPE ids are no per-sample positions to split by.
    if has_images or not (varlen_attention and all(_is_plain(r) for r in rows)):
        input_ids = np.concatenate([r.input_ids for r in rows])
        position_ids = np.concatenate([r.position_ids for r in rows])
        cuttable = not has_images and not any(has_routing)
        forwards = padded_forwards(
            input_ids, position_ids, parents, device, one_forward, pair_weight if cuttable else 0.0
        )
    loss_mask = cat("loss_mask", torch.bool)
    where = loss_mask.nonzero().squeeze(-1)
    temperatures = cat("temperatures", torch.float32)
    loss = LossTokens(
        positions=where,
        predicted_from=parent_ids[where],
        targets=cat("input_ids", torch.long)[where],
        temperatures=temperatures[where],
        inference_logprobs=cat("inference_logprobs", torch.float32)[where],
        advantages=cat("advantages", torch.float32)[where],
        sequence_ids=sequence_segments(parent_ids)[where],
        teacher_logprobs=cat("teacher_logprobs", torch.float32)[where] if all(has_teacher) else None,
        kept_counts=_kept_counts(rows, device)[where]
        if any(r.kept_counts is not None for r in rows)
        else None,
    )
    return MicroBatch(
        input_ids=cat("input_ids", torch.long),
        position_ids=cat("position_ids", torch.long),
        parent_ids=parent_ids,
        forwards=forwards,
        temperatures=temperatures,
        loss=loss,
        num_sequence_tokens=sum(sum(r.sequence_lengths()) for r in rows),
        routed_experts=_routing(rows, device) if all(has_routing) else None,
        vision=build_vision_inputs(rows, vision, device) if vision is not None else None,
        rows=[RowExtent(r.num_tokens, r.num_loss_tokens, r.num_loss_samples) for r in rows],
    )


def _kept_counts(rows: list[PackedRow], device: torch.device) -> torch.Tensor:
    """The rows' kept_counts as one [T] int32 tensor; a row without them counts 0 (the rules decide)."""
    import torch

    parts = [r.kept_counts if r.kept_counts is not None else np.zeros(r.num_tokens, np.int32) for r in rows]
    return torch.from_numpy(np.concatenate(parts)).to(device=device, dtype=torch.int32)


def _routing(rows: list[PackedRow], device: torch.device) -> torch.Tensor:
    """The rows' routed_experts as one [T, layers, top_k] int16 tensor, NO_ROUTING entries as -1."""
    import torch

    from grpo.transport.batches.batch import no_routing

    parts = []
    for row in rows:
        routing = row.routed_experts
        assert routing is not None
        missing = routing == no_routing(routing.dtype)
        if np.any(routing[~missing] >= 2**15):
            raise ValueError("routed_experts holds expert ids >= 32768; no model has that many experts")
        ids: np.ndarray = routing.astype(np.int16)
        ids[missing] = -1
        parts.append(ids)
    return torch.from_numpy(np.concatenate(parts)).to(device)


def _pieces(parent_ids: np.ndarray, pair_weight: float) -> list[Piece]:
    """Each independent piece (the tokens under one root, in order), wide prefix trees cut at their
    trunks where `pair_weight` says that costs less (grpo.trainer.tree_split)."""
    root = np.empty_like(parent_ids)
    for token, parent in enumerate(parent_ids.tolist()):
        root[token] = token if parent < 0 else root[parent]
    order = np.argsort(root, kind="stable")
    boundaries = np.flatnonzero(np.diff(root[order])) + 1
    whole = [Piece(indices, np.ones(len(indices), bool)) for indices in np.split(order, boundaries)]
    return [cut for piece in whole for cut in cut_at_trunks(piece, parent_ids, pair_weight)]


# Whole prefix trees of a short-answer batch (8 groups of 8, 3-24 completion tokens) padded to the
# longest in one call: ~9% of the tokens in the decoder's linears were padding; 64 plain samples of
# 18-65 tokens: 21%. On 2 CPU cores, cutting a call where a piece is 5% shorter than its longest,
# unless the call holds under 256 tokens, left 3-4% and made the trainer step ~5% and 15% faster.
# Without the 256-token floor (16 calls for the plain samples) the step was 3% slower than before:
# each call has a fixed cost. CPU only: on a GPU that cost is worth far more tokens, unmeasured.
CPU_PADDING_TOLERANCE = 0.05
CPU_MIN_CALL_TOKENS = 256


def padded_forwards(
    input_ids: np.ndarray,
    position_ids: np.ndarray,
    parent_ids: np.ndarray,
    device: torch.device,
    one_forward: bool = False,
    pair_weight: float = 0.0,
) -> list[Forward]:
    """A micro-batch's pieces ([T] arrays, micro-batch parent indices), longest first, batched into
    padded calls of at most as many (padded) tokens as the micro-batch itself holds, so activation
    memory stays that of the micro-batch (or all in one call with `one_forward`); cut trees' trunk
    copies add to it (at most grpo.trainer.tree_split.MAX_ADDED_FRACTION of a tree). On CPU a piece
    much shorter than its call's longest starts a new call: every padded token costs a whole token
    in every linear layer."""
    import torch

    pieces = sorted(_pieces(parent_ids, pair_weight), key=len, reverse=True)
    budget = max(int(input_ids.shape[0]), len(pieces[0]))
    batches = pieces_per_call(pieces, budget, device.type == "cpu", one_forward)
    forwards = []
    for batch in batches:
        num_pieces, length = len(batch), len(batch[0])
        ids: np.ndarray = np.zeros((num_pieces, length), np.int64)
        positions: np.ndarray = np.zeros((num_pieces, length), np.int64)
        mask = torch.eye(length, dtype=torch.bool).repeat(num_pieces, 1, 1, 1)  # [B, 1, L, L]
        slots: list[np.ndarray] = []
        for b, cut in enumerate(batch):
            piece, n = cut.indices, len(cut)
            ids[b, :n] = input_ids[piece]
            positions[b, :n] = position_ids[piece]
            parents = torch.from_numpy(piece_parents(piece, parent_ids))
            mask[b, 0, :n, :n] = tree_attention_mask(parents)[0, 0]
            slots.append(b * length + np.flatnonzero(cut.owned))
        forwards.append(
            Forward(
                input_ids=torch.from_numpy(ids).to(device),
                position_ids=torch.from_numpy(positions).to(device),
                attention_mask=mask.to(device),
                slots=torch.from_numpy(np.concatenate(slots)).to(device),
                tokens=torch.from_numpy(np.concatenate([cut.indices[cut.owned] for cut in batch])).to(device),
            )
        )
    return forwards


def pieces_per_call(pieces: list[P], budget: int, on_cpu: bool, one_forward: bool = False) -> list[list[P]]:
    """Pieces (longest first) grouped into padded calls of at most `budget` padded tokens. On CPU a
    piece more than CPU_PADDING_TOLERANCE shorter than its call's longest starts a new call, unless
    the call holds under CPU_MIN_CALL_TOKENS (too small to be worth its fixed cost)."""
    tolerance = CPU_PADDING_TOLERANCE if on_cpu else 1.0
    calls: list[list[P]] = [pieces[:1]]
    for piece in pieces[1:]:
        call = calls[-1]
        longest = len(call[0])
        fits = (len(call) + 1) * longest <= budget
        small = len(call) * longest < CPU_MIN_CALL_TOKENS
        if one_forward or (fits and (small or len(piece) >= (1 - tolerance) * longest)):
            call.append(piece)
        else:
            calls.append([piece])
    return calls


def token_micro_batches(rows: list[PackedRow], budget: int) -> list[list[PackedRow]]:
    """Consecutive rows grouped into micro-batches of at most `budget` tokens (a row above it alone):
    the orchestrator packs rows of the same budget, so a row and the prefix trees in it stay whole."""
    groups: list[list[PackedRow]] = []
    num_tokens = 0
    for row in rows:
        if groups and num_tokens + row.num_tokens <= budget:
            groups[-1].append(row)
            num_tokens += row.num_tokens
        else:
            groups.append([row])
            num_tokens = row.num_tokens
    return groups


def split_micro_batches(items: list[T], group_size: int) -> list[list[T]]:
    """Consecutive groups of `group_size` (the last may be shorter): rows into micro-batches, or
    micro-batches into backward groups."""
    return [items[i : i + group_size] for i in range(0, len(items), group_size)]


def empty_row() -> PackedRow:
    """A two-token row with no loss: fills a rank that has fewer rows than the others. Two tokens so
    it still predicts one token: its zero loss keeps a graph, and every rank runs backward (FSDP
    needs all ranks in every gradient reduction)."""
    return PackedRow(
        input_ids=np.zeros(2, np.int32),
        position_ids=np.arange(2, dtype=np.int32),
        loss_mask=np.zeros(2, np.bool_),
        advantages=np.zeros(2, np.float32),
        inference_logprobs=np.zeros(2, np.float32),
        temperatures=np.ones(2, np.float32),
        parent_ids=np.array([-1, 0], np.int32),
    )
