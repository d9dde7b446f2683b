"""The consistency probe: the engine's next-token distributions at a few sampled positions, shipped
in a batch so the trainer can compare its own distribution there (grpo.trainer.consistency).

The sampled-token mismatch KL the trainer logs every step sees only the tokens that were sampled. A
probe sees the engine's whole distribution (its top `K` tokens, and the mass of the rest) at every
position of a few fresh completions, sampled and scored by the policy version the trainer holds
when it trains on the batch (`policy_version`, the batch's step). What that catches and the
sampled-token KL hides: a chat template other than the model's, a stale adapter, a truncation rule
that differs at the boundary.

On the wire each sequence is three more safetensors tensors (`probe.{j}.{input_ids,engine_top_ids,
engine_top_logprobs}`, and `probe.{j}.engine_kept_counts` when the engine reported them) and the
header's `probe` entry holds the numbers (grpo.transport.batches.wire).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROBE_ARRAYS: dict[str, type] = {
    "input_ids": np.int32,
    "engine_top_ids": np.int32,
    "engine_top_logprobs": np.float32,
}
KEPT_COUNTS_ARRAY = "engine_kept_counts"


@dataclass
class ProbeSequence:
    """One probed completion: its prompt as the orchestrator rendered it, then the completion."""

    input_ids: np.ndarray
    """[num_tokens] int32: the orchestrator's prompt ids, then the completion's ids: what the trainer
    computes on."""
    num_prompt_tokens: int
    """The completion starts here; each completion token's position is probed."""
    engine_top_ids: np.ndarray
    """[num_completion_tokens, K] int32: the engine's K most likely next tokens before each completion
    token, most likely first."""
    engine_top_logprobs: np.ndarray
    """[num_completion_tokens, K] float32: their logprobs under the engine's untempered, untruncated
    distribution (vLLM's prompt logprobs)."""
    temperature: float
    """The temperature the completion was sampled at (the kept sets are judged at it)."""
    engine_prompt_matches: bool
    """The engine renders the prompt's messages with its own chat template to the orchestrator's
    prompt ids. When it does not, the engine was scored on its own rendering and the trainer on the
    orchestrator's, so the divergences show what the difference does to the model."""
    engine_kept_counts: np.ndarray | None = None
    """[num_completion_tokens] int32: how many tokens the engine's sampler kept when it sampled each
    completion token (a grpo CPU engine reports it), 0 where it reported none; None: none at all."""

    @property
    def num_completion_tokens(self) -> int:
        return int(self.input_ids.shape[0]) - self.num_prompt_tokens

    def validate(self, where: str) -> None:
        for name, dtype in PROBE_ARRAYS.items():
            array = getattr(self, name)
            if array.dtype != np.dtype(dtype):
                raise ValueError(f"{where} {name} has dtype {array.dtype}, expected {np.dtype(dtype)}")
        if self.input_ids.ndim != 1 or not 0 < self.num_prompt_tokens < self.input_ids.shape[0]:
            raise ValueError(
                f"{where} needs 1-D input_ids with a prompt and at least one completion token, got "
                f"{self.input_ids.shape} tokens with {self.num_prompt_tokens} in the prompt"
            )
        shape = self.engine_top_ids.shape
        if len(shape) != 2 or shape[0] != self.num_completion_tokens or shape[1] < 1:
            raise ValueError(
                f"{where} engine_top_ids has shape {shape}, expected ({self.num_completion_tokens}, K >= 1)"
            )
        if self.engine_top_logprobs.shape != shape:
            raise ValueError(
                f"{where} engine_top_logprobs has shape {self.engine_top_logprobs.shape}, expected {shape}"
            )
        # a logprob near 0 may round a hair above it; NaN fails too
        if not np.all(self.engine_top_logprobs <= 1e-4):
            raise ValueError(f"{where} engine_top_logprobs must be logprobs (<= 0, not NaN)")
        if not self.temperature > 0.0:
            raise ValueError(f"{where} temperature must be > 0, got {self.temperature}")
        counts = self.engine_kept_counts
        if counts is not None and (
            counts.dtype != np.int32 or counts.shape != (self.num_completion_tokens,) or counts.min() < 0
        ):
            raise ValueError(
                f"{where} engine_kept_counts must be ({self.num_completion_tokens},) int32 >= 0, got "
                f"{counts.shape} {counts.dtype}"
            )


@dataclass
class ConsistencyProbe:
    """The probe a batch carries: every sequence scored by the engine running `policy_version`."""

    policy_version: int
    sequences: list[ProbeSequence] = field(default_factory=list)
    warn_kl: float = 1e-3
    """The trainer warns when the mean KL over the probed positions is above it (orch
    consistency_check.warn_kl)."""

    def validate(self, vocab_size: int | None = None) -> None:
        if self.policy_version < 0 or not self.sequences:
            raise ValueError("consistency probe needs a policy version >= 0 and at least one sequence")
        for j, sequence in enumerate(self.sequences):
            sequence.validate(f"consistency probe sequence {j}")
            for name in ("input_ids", "engine_top_ids"):
                ids = getattr(sequence, name)
                if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
                    raise ValueError(
                        f"consistency probe sequence {j} {name} must be token ids in [0, {vocab_size})"
                    )

    def header(self) -> dict[str, Any]:
        """The numbers of the probe, for the wire header (its arrays travel as tensors)."""
        return {
            "policy_version": self.policy_version,
            "warn_kl": self.warn_kl,
            "sequences": [
                {
                    "num_prompt_tokens": s.num_prompt_tokens,
                    "temperature": s.temperature,
                    "engine_prompt_matches": s.engine_prompt_matches,
                }
                for s in self.sequences
            ],
        }

    def to_tensors(self) -> dict[str, np.ndarray]:
        tensors = {}
        for j, sequence in enumerate(self.sequences):
            for name in (*PROBE_ARRAYS, KEPT_COUNTS_ARRAY):
                array = getattr(sequence, name)
                if array is not None:
                    tensors[f"probe.{j}.{name}"] = np.ascontiguousarray(array)
        return tensors

    @staticmethod
    def from_wire(header: Any, tensors: dict[str, np.ndarray]) -> ConsistencyProbe:
        """The probe from its header entry and the batch's tensors; ValueError when they disagree."""
        if not isinstance(header, dict) or not isinstance(header.get("sequences"), list):
            raise ValueError("probe header must be an object with a list of sequences")
        sequences = []
        for j, numbers in enumerate(header["sequences"]):
            if not isinstance(numbers, dict):
                raise ValueError(f"probe sequence {j} header must be an object")
            arrays = {}
            for name in PROBE_ARRAYS:
                key = f"probe.{j}.{name}"
                if key not in tensors:
                    raise ValueError(f"probe lacks tensor {key}")
                arrays[name] = tensors[key]
            sequences.append(
                ProbeSequence(
                    **arrays,
                    num_prompt_tokens=int(numbers["num_prompt_tokens"]),
                    temperature=float(numbers["temperature"]),
                    engine_prompt_matches=bool(numbers["engine_prompt_matches"]),
                    engine_kept_counts=tensors.get(f"probe.{j}.{KEPT_COUNTS_ARRAY}"),
                )
            )
        return ConsistencyProbe(
            policy_version=int(header["policy_version"]),
            sequences=sequences,
            warn_kl=float(header["warn_kl"]),
        )

    def tensor_names(self) -> set[str]:
        return {
            f"probe.{j}.{name}"
            for j in range(len(self.sequences))
            for name in (*PROBE_ARRAYS, KEPT_COUNTS_ARRAY)
        }
