"""Cutting a wide prefix tree at its trunk so that attention costs less than the copies add.

A padded decoder call attends densely: a piece of L tokens costs L^2 attention pairs whatever its
mask hides (grpo.trainer.packing). A prefix tree whose root chain (its trunk) is short and whose
branches are long pays for every pair between two branches, none of which its mask lets through.
Short-answer's step is the worst case: its eight groups share the chat template's system turn (the
trunk, ~20 tokens), so the step's 64 completions form one tree of ~920 tokens, and on 2 CPU cores
the masked attention over it (forward and backward) took ~1.6 s of a ~5.6 s trainer step.

Here such a tree becomes one piece per branch, each the trunk followed by that branch: the branches'
tokens run once, the trunk once per branch. Only the first copy of a trunk token is the piece's own
(`owned`: its hidden state is the one the loss reads); the others are context the branch attends to.
Every copy computes the same function of the weights, and each passes back the gradient of what
reads it (its branch's attention, or the loss through the owned copy), so the step's gradient is
the uncut tree's. Splitting repeats at each branching point while the estimated cost falls:

    cost(piece) = tokens + pair_weight * tokens^2

`pair_weight` is the cost of one attended pair in tokens (grpo.trainer.hf's policy sets it from the
model's shape on CPU); 0 never cuts. Long-brief's 350-token trunk is never cut: eight copies cost
far more than the pairs they save.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Masked attention (forward + backward: flash attention's backward is ~2.3x its forward) per FLOP
# against the decoder's linear layers per FLOP (forward + activations' gradients) on 2 AVX512-BF16
# CPU cores, the trainer's bf16 step on SmolLM2-135M: ~9.3 ps against ~3.3 ps.
CPU_ATTENTION_FLOP_COST = 2.8

# At most this much more tokens per cut piece: every copy is activation memory the plan did not
# budget for.
MAX_ADDED_FRACTION = 0.25


@dataclass(frozen=True)
class Piece:
    """Micro-batch indices of one padded-call piece, parents first, and which of them it owns."""

    indices: np.ndarray
    """[n] micro-batch token indices, each token's parent before it."""
    owned: np.ndarray
    """[n] bool: the piece computes this token for the micro-batch (False: a copy kept as context)."""

    def __len__(self) -> int:
        return int(self.indices.shape[0])


def pair_weight_for(
    num_decoder_linear_params: int, num_layers: int, attention_width: int, trains_base: bool
) -> float:
    """Cost of one attended pair in tokens: attention's FLOPs per pair (forward 4 d_attn, backward twice
    that) over the linears' per token (forward 2 P, activations' gradients 2 P, weights' gradients
    2 P when the base trains), each weighted by its time per FLOP on CPU."""
    pair_flops = 12 * attention_width * num_layers
    token_flops = (6 if trains_base else 4) * num_decoder_linear_params
    return CPU_ATTENTION_FLOP_COST * pair_flops / token_flops


def cut_at_trunks(piece: Piece, parent_ids: np.ndarray, pair_weight: float) -> list[Piece]:
    """`piece` as it is, or cut into trunk + branch pieces (recursively) where that costs less."""
    if pair_weight <= 0:
        return [piece]
    branches = _branches(piece, parent_ids)
    if branches is None:
        return [piece]
    trunk_length, branch_pieces = branches
    added = (len(branch_pieces) - 1) * trunk_length
    cut_cost = sum(_cost(len(p), pair_weight) for p in branch_pieces)
    if added > MAX_ADDED_FRACTION * len(piece) or cut_cost >= _cost(len(piece), pair_weight):
        return [piece]
    return [cut for branch in branch_pieces for cut in cut_at_trunks(branch, parent_ids, pair_weight)]


def piece_parents(indices: np.ndarray, parent_ids: np.ndarray) -> np.ndarray:
    """[n] each token's parent as a position in `indices` (-1 for the root); `indices` [n] holds
    micro-batch tokens whose parents, but the root's, are among them."""
    local = np.full(parent_ids.shape[0], -1, np.int64)
    local[indices] = np.arange(len(indices))
    parents = parent_ids[indices]
    return np.where(parents < 0, -1, local[parents])


def _cost(num_tokens: int, pair_weight: float) -> float:
    return num_tokens + pair_weight * num_tokens * num_tokens


def _branches(piece: Piece, parent_ids: np.ndarray) -> tuple[int, list[Piece]] | None:
    """(trunk length, trunk + branch pieces) at the first token with two or more children, or None
    for a chain. The trunk is the chain of tokens from the root down to that token."""
    indices = piece.indices
    local_parents = piece_parents(indices, parent_ids)
    num_children = np.bincount(local_parents[local_parents >= 0], minlength=len(indices))
    # Tokens are parents first, so the trunk is the prefix before the first branching token.
    branching = np.flatnonzero(num_children >= 2)
    if branching.size == 0:
        return None
    fork = int(branching[0])
    trunk = np.arange(fork + 1)
    # Each token after the fork belongs to the branch of its ancestor among the fork's children.
    branch_of: np.ndarray = np.full(len(indices), -1, np.int64)
    for k in range(fork + 1, len(indices)):
        parent = local_parents[k]
        branch_of[k] = k if parent == fork else branch_of[parent]
    pieces = []
    for number, head in enumerate(np.flatnonzero(local_parents == fork)):
        members = np.concatenate([trunk, np.flatnonzero(branch_of == head)])
        owned = piece.owned[members].copy()
        if number > 0:
            owned[: len(trunk)] = False
        pieces.append(Piece(indices[members], owned))
    return len(trunk), pieces
