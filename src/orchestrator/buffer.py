"""Which example to roll out next, and which groups are worth training on.

Sampling is deterministic given the seed and the number of examples sampled so far (each draw seeds
its own RNG from both), so a checkpoint only needs that counter plus the easy/hard pools.

Examples are identified by a hash of their `hash_keys` fields (a prompt's images by their pixels);
duplicates within an environment are sampled as one. After a group is scored, an example whose mean
reward is above easy_threshold moves to the easy pool and one below hard_threshold to the hard pool;
neither pool is sampled. On resume, easy_fraction / hard_fraction of them return to the normal pool.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

from grpo.config.orchestrator import BufferConfig
from grpo.envs.base import Environment, Example
from grpo.orchestrator.env_labels import env_labels
from grpo.orchestrator.types import Group
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")


def example_hash(example: Example, keys: Sequence[str]) -> str:
    payload = json.dumps({k: example.get(k) for k in keys}, sort_keys=True, default=_by_content)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _by_content(value: Any) -> str:
    """What json cannot write, as text: a PIL image (a prompt's image part) by its pixels, since its
    repr holds its address and would give an example another hash in every process (a resumed run's
    easy and hard pools would match nothing); anything else by str(), which for a dataset's
    EncodedImage names its bytes' digest."""
    if type(value).__module__.startswith("PIL."):  # Pillow is imported only where images are
        from PIL import Image

        if isinstance(value, Image.Image):
            pixels = hashlib.sha256(value.tobytes()).hexdigest()
            return f"image {value.mode} {value.size[0]}x{value.size[1]} {pixels}"
    return str(value)


class Buffer:
    def __init__(self, envs: Sequence[Environment], cfg: BufferConfig, seed: int) -> None:
        self.envs = list(envs)
        self.cfg = cfg
        self.seed = cfg.seed if cfg.seed is not None else seed
        ratios = cfg.env_ratios if cfg.env_ratios is not None else [1.0] * len(self.envs)
        if len(ratios) != len(self.envs):
            raise ValueError(f"buffer.env_ratios has {len(ratios)} entries for {len(self.envs)} environments")
        self.env_ratios = list(ratios)
        self.num_sampled = 0
        # per env: hash -> index of its first example (duplicates collapse onto it)
        self._index: list[dict[str, int]] = []
        for env in self.envs:
            unique: dict[str, int] = {}
            for i, example in enumerate(env.examples):
                unique.setdefault(example_hash(example, cfg.hash_keys), i)
            self._index.append(unique)
        self.easy: list[set[str]] = [set() for _ in self.envs]
        self.hard: list[set[str]] = [set() for _ in self.envs]
        self._warned_empty: set[int] = set()
        # normal-pool hashes per env, rebuilt only when the pools change (sampling is per rollout group)
        self._normal: list[list[str] | None] = [None] * len(self.envs)

    def _normal_hashes(self, env_index: int) -> list[str]:
        cached = self._normal[env_index]
        if cached is not None:
            return cached
        excluded = self.easy[env_index] | self.hard[env_index]
        hashes = [h for h in self._index[env_index] if h not in excluded]
        if not hashes:
            if env_index not in self._warned_empty:
                log.warning(
                    "env %s: every example is easy or hard; sampling all of them", self.envs[env_index].name
                )
                self._warned_empty.add(env_index)
            hashes = list(self._index[env_index])
        self._normal[env_index] = hashes
        return hashes

    def sample(self) -> tuple[int, int, Example]:
        """(env index, example index, example) of the next example to roll out."""
        rng = random.Random(f"{self.seed}:{self.num_sampled}")
        self.num_sampled += 1
        env_index = rng.choices(range(len(self.envs)), weights=self.env_ratios)[0]
        hashes = self._normal_hashes(env_index)
        example_index = self._index[env_index][hashes[rng.randrange(len(hashes))]]
        return env_index, example_index, self.envs[env_index].examples[example_index]

    def keep_group(self, group: Group) -> bool:
        """False when online difficulty filtering drops the group (the rewards of its rollouts that
        did not fail all 0.0 or all 1.0). A group whose rollouts all failed is kept: the batch drops
        it and counts it as failed (failed/num_groups), not as too easy or too hard."""
        rewards = group.finished_rewards
        if not self.cfg.online_difficulty_filtering or not rewards:
            return True
        return not (all(r == 0.0 for r in rewards) or all(r == 1.0 for r in rewards))

    def update(self, env_index: int, group: Group) -> None:
        """Move the group's example to the easy or hard pool by the mean reward of its rollouts that
        did not fail; a group whose rollouts all failed says nothing about it, and it stays put."""
        rewards = group.finished_rewards
        if not rewards:
            return
        mean = sum(rewards) / len(rewards)
        key = example_hash(group.example, self.cfg.hash_keys)
        if self.cfg.easy_threshold is not None and mean > self.cfg.easy_threshold:
            self.easy[env_index].add(key)
            self._normal[env_index] = None
        elif self.cfg.hard_threshold is not None and mean < self.cfg.hard_threshold:
            self.hard[env_index].add(key)
            self._normal[env_index] = None

    def state(self) -> dict[str, Any]:
        """The pools keyed by environment label (grpo.orchestrator.env_labels)."""
        labels = env_labels(self.envs)
        return {
            "num_sampled": self.num_sampled,
            "easy": {label: sorted(p) for label, p in zip(labels, self.easy, strict=True)},
            "hard": {label: sorted(p) for label, p in zip(labels, self.hard, strict=True)},
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed state, then promote easy/hard fractions back to the normal pool."""
        self.num_sampled = int(state["num_sampled"])
        rng = random.Random(f"{self.seed}:promote:{self.num_sampled}")
        for i, label in enumerate(env_labels(self.envs)):
            self.easy[i] = _demote(set(state["easy"].get(label, [])), self.cfg.easy_fraction, rng)
            self.hard[i] = _demote(set(state["hard"].get(label, [])), self.cfg.hard_fraction, rng)
        self._normal = [None] * len(self.envs)


def _demote(pool: set[str], fraction: float, rng: random.Random) -> set[str]:
    """The pool minus a random `fraction` of it (those return to the normal pool)."""
    ordered = sorted(pool)
    promoted = set(rng.sample(ordered, round(fraction * len(ordered))))
    return pool - promoted
