"""Shared-prefix packing: samples that begin with the same tokens store those tokens once.

Every rollout of a GRPO group repeats its prompt, and with long prompts (agent briefs, tool
specifications) most of a step's tokens are copies. Here samples are merged into prefix trees: a
trie over each sample's leading tokens, emitted depth-first into one row, every token recording its
parent (grpo.transport.batches.batch: `parent_ids`). The trainer attends along parent chains only, so every
completion sees exactly its own prompt and the forward and backward of the prompt run once.

Only tokens that carry no loss are shared, and only where every per-token field agrees (id, and the
values the trainer reads for it): a loss token's advantage and behaviour logprob belong to one
sample, so from a sample's first loss token on it is stored on its own (its "tail"). The loss
therefore sees the same loss tokens with the same values as unshared packing, and the step's
gradient is unchanged.

Per-token fields may have more axes than the token one (`routed_experts`: [tokens, layers, top_k]);
such a token's key holds the bytes of its entry, so a shared prompt token's routing is stored once
where the engine routed it the same way for every sample that shares it.

Token ids come from the rollouts (token-in/token-out), never from re-tokenised text, so equal ids
mean equal model inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

Sample = dict[str, np.ndarray]
"""Per-token arrays of one sample (the PackedRow fields except parent_ids), all [length]."""


@dataclass
class _Node:
    sample: int
    position: int
    """Where this token's values are read from: samples[sample][field][position]."""
    children: dict[tuple[Any, ...], _Node] = field(default_factory=dict)
    tails: list[int] = field(default_factory=list)
    """Samples whose shared part ends at this node; their remaining tokens hang from it."""


@dataclass
class _Tree:
    """One packable item: a root, everything below it, and the token count it will occupy."""

    root_tails: list[int] = field(default_factory=list)
    children: dict[tuple[Any, ...], _Node] = field(default_factory=dict)
    num_tokens: int = 0


def _shareable_keys(sample: Sample) -> list[tuple[Any, ...]]:
    """Keys of the sample's leading tokens that may be shared: up to its first loss token."""
    loss = sample["loss_mask"]
    num_shareable = int(np.argmax(loss)) if loss.any() else loss.shape[0]
    names = sorted(name for name in sample if name != "loss_mask")
    columns = [_token_keys(sample[name][:num_shareable]) for name in names]
    return list(zip(*columns, strict=True))


def _token_keys(values: np.ndarray) -> list[Any]:
    """One hashable key per token: the value, or the bytes of a token's entry of a multi-axis field."""
    if values.ndim == 1:
        return values.tolist()
    return [entry.tobytes() for entry in values]


def _matched_depth(tree: _Tree, keys: list[tuple[Any, ...]]) -> int:
    level = tree.children
    depth = 0
    for key in keys:
        node = level.get(key)
        if node is None:
            break
        level = node.children
        depth += 1
    return depth


def _insert(tree: _Tree, index: int, keys: list[tuple[Any, ...]]) -> None:
    level, parent_tails = tree.children, tree.root_tails
    for depth, key in enumerate(keys):
        node = level.get(key)
        if node is None:
            node = _Node(index, depth)
            level[key] = node
        level, parent_tails = node.children, node.tails
    parent_tails.append(index)


def _emit(tree: _Tree, samples: list[Sample]) -> Sample:
    """Depth-first layout of one tree as a row segment, parents before children."""
    sources: list[tuple[int, int]] = []
    parents: list[int] = []

    def emit_tail(sample: int, parent: int) -> None:
        start = 0 if parent < 0 else sources[parent][1] + 1
        for position in range(start, samples[sample]["input_ids"].shape[0]):
            sources.append((sample, position))
            parents.append(parent)
            parent = len(sources) - 1

    # Explicit stack: prompts run to thousands of tokens, deeper than Python's recursion limit.
    stack: list[tuple[_Node | int, int]] = [(s, -1) for s in reversed(tree.root_tails)]
    stack += [(node, -1) for node in reversed(tree.children.values())]
    while stack:
        item, parent = stack.pop()
        if isinstance(item, int):
            emit_tail(item, parent)
            continue
        sources.append((item.sample, item.position))
        parents.append(parent)
        here = len(sources) - 1
        stack += [(s, here) for s in reversed(item.tails)]
        stack += [(child, here) for child in reversed(item.children.values())]
    sample_of = np.array([s for s, _ in sources], dtype=np.int64)
    position_of = np.array([p for _, p in sources], dtype=np.int64)
    out: Sample = {}
    for name in samples[0]:
        first = samples[0][name]
        values: np.ndarray = np.empty((len(sources), *first.shape[1:]), dtype=first.dtype)
        for index in np.unique(sample_of):
            picked = sample_of == index
            values[picked] = samples[index][name][position_of[picked]]
        out[name] = values
    out["parent_ids"] = np.asarray(parents, dtype=np.int32)
    return out


def build_prefix_trees(samples: list[Sample], max_tokens: int) -> list[Sample]:
    """Merge `samples` into prefix trees of at most `max_tokens` tokens each; returns row segments
    (per-token arrays plus parent_ids). A tree that would grow past `max_tokens` is closed and the
    next sample with that first token opens a new one, so a group too long for one row is split
    into trees that fit instead of losing its sharing."""
    open_trees: dict[tuple[Any, ...] | int, _Tree] = {}
    trees: list[_Tree] = []
    for index, sample in enumerate(samples):
        keys = _shareable_keys(sample)
        length = int(sample["input_ids"].shape[0])
        # A sample with nothing to share gets a tree of its own (keyed so nothing else joins it).
        root_key: tuple[Any, ...] | int = keys[0] if keys else -1 - index
        tree = open_trees.get(root_key)
        cost = length - (_matched_depth(tree, keys) if tree is not None else 0)
        if tree is None or tree.num_tokens + cost > max_tokens:
            tree = _Tree()
            trees.append(tree)
            open_trees[root_key] = tree
            cost = length
        _insert(tree, index, keys)
        tree.num_tokens += cost
    segments = [_emit(tree, samples) for tree in trees]
    assert all(s["input_ids"].shape[0] == t.num_tokens for s, t in zip(segments, trees, strict=True))
    return segments
