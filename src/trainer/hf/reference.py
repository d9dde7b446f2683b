"""The frozen reference policy of loss.kl_beta (docs/loss.md, "KL to a frozen reference").

LoRA (and QLoRA, and borrowed base weights): the reference is the base model itself, run with
every adapter disabled (peft's `disable_adapter`), so no second copy of the weights exists; it is
the policy the run started from, since LoRA's B starts at zero. Full-parameter training: a frozen
deep copy of the initial weights on the training device (the config refuses this with several
GPUs, where the policy is sharded and the copy would not be).

The reference's logprobs are computed exactly as the policy's: the same packed micro-batch (its
shared-prefix forwards and masks included), the same bf16 autocast forward, the same chunked
float32 head at the token's sampling temperature, under torch.no_grad.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from grpo.trainer.hf.model import Policy
    from grpo.trainer.packing import MicroBatch


class ReferencePolicy:
    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._copy: Policy | None = None
        """The frozen copy (full-parameter training); None for LoRA."""
        if not policy.is_lora:
            frozen = copy.deepcopy(policy.causal_lm).requires_grad_(False)
            self._copy = dataclasses.replace(policy, model=frozen, causal_lm=frozen)

    @contextlib.contextmanager
    def _active(self) -> Iterator[Policy]:
        if self._copy is not None:
            yield self._copy
            return
        with self._policy.model.disable_adapter():
            yield self._policy

    def token_logprobs(self, mb: MicroBatch, chunk_size: int | None) -> torch.Tensor:
        """The reference's logprobs [N] of the micro-batch's loss tokens (mb.loss), float32."""
        import torch

        from grpo.trainer.logprobs import token_logprobs

        tokens = mb.loss
        with torch.no_grad(), self._active() as policy:
            hidden = policy.hidden_states(mb)
            lp, _ = token_logprobs(
                hidden[tokens.predicted_from], policy.lm_head, tokens.targets, tokens.temperatures, chunk_size
            )
        return lp
