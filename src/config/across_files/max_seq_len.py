"""`max_seq_len`: the one length a user sets, the longest sequence of a run (prompt and completion).

Each process has a length of its own: the trainer's packed rows (train.yaml `sequence_len`), the
orchestrator's samples and rows (orch.yaml `seq_len`) and the engine's context (infer.yaml
`max_model_len`). `max_seq_len`, at the top of rl.yaml or in any one file (a shared fact,
grpo.config.across_files.shared_facts, so it reaches the others), sets each of them that its file leaves unset,
before validation, so everything downstream (derived settings, cross-checks, the memory plan) sees
them as set. orch.yaml `sampling.max_tokens` stays its own key and must leave room for the prompt
(grpo.config.across_files.crosscheck).
"""

from __future__ import annotations

from typing import Any

MAX_SEQ_LEN = "max_seq_len"


def fill_length(data: Any, length_key: str) -> Any:
    """A config's input mapping with `length_key` set to its max_seq_len where only the latter is given."""
    if not isinstance(data, dict) or data.get(MAX_SEQ_LEN) is None or data.get(length_key) is not None:
        return data
    return {**data, length_key: data[MAX_SEQ_LEN]}
