"""Partial rollouts across policy updates (orch `partial_rollouts`).

At a policy update the gate stops every generation request in flight (they stream; a stopped one
keeps the tokens and logprobs it has, grpo.inference.streaming), holds new requests until the servers
run the new policy, then lets them go. A stopped choice resumes token in: its prompt plus the tokens
it kept become the new prompt, with the rest of its max_tokens (and min_tokens). Each token records
the policy version that sampled it; a request is sent inside the gate, so the version it reads is the
one the servers run until the gate next closes, and every token it streams was sampled before then.

The oldest token's version is the rollout's `start_version`, so the staleness rules
(max_off_policy_steps) judge a resumed rollout by its oldest token; the trainer's importance ratio
uses each token's own logprob, as it does for every rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from grpo.inference.types import ABORTED, Completion, GenerateRequest, RolloutClient, SamplingParams
from grpo.orchestrator.types import Rollout


class UpdateGate:
    """Generation requests pass while it is open; a policy update closes it, stops the requests in
    flight (their interrupt event is set), waits until all of them have returned, and reopens it
    once the update is done."""

    def __init__(self) -> None:
        self._interrupt = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._num_inside = 0
        self._drained = asyncio.Event()
        self._drained.set()

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[asyncio.Event]:
        """Hold while an update is under way; the body's request stops when the event is set."""
        while not self._open.is_set():
            await self._open.wait()
        self._num_inside += 1
        self._drained.clear()
        try:
            yield self._interrupt
        finally:
            self._num_inside -= 1
            if self._num_inside == 0:
                self._drained.set()

    @contextlib.asynccontextmanager
    async def update(self) -> AsyncIterator[None]:
        """Stop the requests in flight and hold new ones for the body (the policy update)."""
        self._open.clear()
        self._interrupt.set()
        try:
            await self._drained.wait()
            yield
        finally:
            self._interrupt = asyncio.Event()
            self._open.set()


@dataclass
class Resumed:
    """One choice of a generation, put together from the requests it took."""

    completion: Completion
    """Every token and logprob in order; text decoded from all of them when it was resumed."""
    versions: list[int]
    """Policy version that sampled each token; len == len(completion.token_ids)."""
    start_version: int
    """The version of its first request (its oldest tokens'; the only one when it has no token)."""
    num_resumes: int = 0
    """Times it resumed with tokens kept."""
    num_recovered_tokens: int = 0
    """Tokens it had when it last resumed: sampled before an update and kept, not sampled again."""

    def extend(self, c: Completion, version: int) -> None:
        self.completion.token_ids += c.token_ids
        self.completion.logprobs += c.logprobs
        self.completion.text += c.text
        self.completion.finish_reason = c.finish_reason
        self.versions += [version] * len(c.token_ids)


class ResumingGenerator:
    """Generates through the gate and resumes stopped choices under the policy that follows."""

    def __init__(
        self,
        client: RolloutClient,
        gate: UpdateGate,
        version: Callable[[], int],
        request: Callable[[list[int], SamplingParams, int, str | None], GenerateRequest],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.client = client
        self.gate = gate
        self.version = version
        """The version the servers run (read inside the gate, where it cannot change)."""
        self.request = request
        """(prompt ids, params, n, session) -> the request, named and salted for the current policy."""
        self.decode = decode

    async def _send(
        self, prompt_ids: list[int], params: SamplingParams, n: int, session: str | None
    ) -> tuple[list[Completion], int]:
        async with self.gate.request() as interrupt:
            version = self.version()
            request = self.request(prompt_ids, params, n, session)
            return await self.client.generate_interruptible(request, interrupt), version

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, n: int, session: str | None = None
    ) -> list[Resumed]:
        """`n` choices of `prompt_ids`, each finished (stop or length), whatever updates came between."""
        # vLLM matches stop strings in the text of one request; a resumed request never sees the
        # text it kept, so a stop string across the seam would go unnoticed. The orchestrator sets none.
        assert not params.stop, "stop strings do not survive a resume"
        completions, version = await self._send(prompt_ids, params, n, session)
        choices = [Resumed(c, [version] * len(c.token_ids), version) for c in completions]
        await asyncio.gather(*(self._finish(prompt_ids, params, session, r) for r in choices))
        return choices

    async def _finish(
        self, prompt_ids: list[int], params: SamplingParams, session: str | None, choice: Resumed
    ) -> None:
        resumed = False
        while choice.completion.finish_reason == ABORTED:
            kept = choice.completion.token_ids
            remaining = None if params.max_tokens is None else params.max_tokens - len(kept)
            if remaining is not None and remaining <= 0:
                choice.completion.finish_reason = "length"
                break
            if kept:
                choice.num_resumes += 1
                choice.num_recovered_tokens = len(kept)
                resumed = True
            rest = replace(
                params,
                max_tokens=remaining,
                min_tokens=max(0, params.min_tokens - len(kept)),
                # a fixed seed would replay the random draws the kept tokens already used
                seed=None if params.seed is None else params.seed + len(kept),
            )
            (c,), version = await self._send(prompt_ids + kept, rest, 1, session)
            choice.extend(c, version)
        if resumed:
            choice.completion.text = self.decode(choice.completion.token_ids)


def partial_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Per step: rollouts that resumed under a newer policy, and the tokens they kept at the updates
    (sampled once instead of being sampled again or finished on the old policy)."""
    return {
        "partial/num_resumed_rollouts": sum(r.num_resumes > 0 for r in rollouts),
        "partial/num_recovered_tokens": sum(r.num_recovered_tokens for r in rollouts),
    }
