"""Wide prefix trees are cut at their trunks only where the copies cost less than the attention
pairs they save, and every token keeps its ancestors and one owner."""

from __future__ import annotations

import numpy as np

from grpo.trainer.tree_split import Piece, cut_at_trunks, pair_weight_for


def _tree(trunk: int, branches: list[list[int]]) -> np.ndarray:
    """parent_ids of a trunk chain of `trunk` tokens with, under its last token, one subtree per
    branch: a chain of branch[0] tokens then chains of the other lengths under its last token."""
    parents = [-1, *list(range(trunk - 1))]
    fork = trunk - 1
    for branch in branches:
        head = len(parents)
        parents += [fork, *list(range(head, head + branch[0] - 1))]
        sub_fork = len(parents) - 1
        for length in branch[1:]:
            start = len(parents)
            parents += [sub_fork, *list(range(start, start + length - 1))]
    return np.array(parents, np.int64)


def _whole(parents: np.ndarray) -> Piece:
    return Piece(np.arange(len(parents)), np.ones(len(parents), bool))


def _ancestors(parents: np.ndarray, token: int) -> set[int]:
    out = set()
    while token >= 0:
        out.add(token)
        token = int(parents[token])
    return out


def test_a_short_trunk_under_long_branches_is_cut_into_one_piece_per_branch():
    parents = _tree(4, [[10, 20, 20], [10, 20, 20], [10, 20, 20]])
    pieces = cut_at_trunks(_whole(parents), parents, pair_weight=0.01)
    assert sorted(len(p) for p in pieces) == [4 + 50] * 3
    owners = np.concatenate([p.indices[p.owned] for p in pieces])
    assert sorted(owners.tolist()) == list(range(len(parents)))  # every token owned exactly once
    for piece in pieces:
        members = set(piece.indices.tolist())
        assert np.all(np.diff(piece.indices) > 0)  # parents first, as the attention mask needs
        for token in piece.indices.tolist():
            assert _ancestors(parents, token) <= members


def test_a_long_trunk_a_tiny_pair_weight_or_zero_leave_the_tree_whole():
    long_trunk = _tree(350, [[10, 20, 20]] * 8)
    assert len(cut_at_trunks(_whole(long_trunk), long_trunk, pair_weight=0.01)) == 1
    short_trunk = _tree(4, [[10, 20, 20]] * 3)
    assert len(cut_at_trunks(_whole(short_trunk), short_trunk, pair_weight=1e-6)) == 1
    assert len(cut_at_trunks(_whole(short_trunk), short_trunk, pair_weight=0.0)) == 1


def test_cuts_repeat_below_the_first_fork_while_they_pay():
    parents = _tree(2, [[3, 60, 60], [3, 60, 60]])
    pieces = cut_at_trunks(_whole(parents), parents, pair_weight=0.05)
    assert sorted(len(p) for p in pieces) == [2 + 3 + 60] * 4


def test_a_cut_adding_more_than_a_quarter_of_the_tree_is_not_made():
    parents = _tree(20, [[2, 3], [2, 3], [2, 3]])  # 3 branches of 5 under 20: +40 tokens on 35
    assert len(cut_at_trunks(_whole(parents), parents, pair_weight=10.0)) == 1


def test_the_pair_weight_of_smollm2_135m_prices_a_pair_near_a_thousandth_of_a_token():
    # SmolLM2-135M: 30 layers, d_attn 576, 106M decoder linear weights.
    weight = pair_weight_for(106_168_320, 30, 576, trains_base=False)
    assert 1e-3 < weight < 2e-3
    assert pair_weight_for(106_168_320, 30, 576, trains_base=True) < weight
