"""Partial rollouts (orch partial_rollouts): a generation stopped at a policy update resumes token in
under the new policy, its tokens exact across the seam and each tagged with the policy that sampled it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from orchestrator_fakes import FakeClient, FakeHfTokenizer, FakeTrainer, QueueSender

from grpo.config.orchestrator import OrchestratorConfig
from grpo.envs import EnvReply, Message, MultiTurnEnv, SingleTurnEnv
from grpo.inference.types import ABORTED, Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.orchestrator import Orchestrator
from grpo.orchestrator.rollouts.partial import UpdateGate
from grpo.orchestrator.rollouts.rollout import GroupRequest, RolloutRunner
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.orchestrator.scheduler import PolicyTracker, oldest_acceptable
from grpo.orchestrator.types import Rollout
from grpo.utils.jsonl import read_jsonl

EOS = 2
CHOICE_BASE = 10_000


def token(choice: int, position: int) -> int:
    """The fake's token for `choice` at absolute position `position` (prompt included): a seam that
    repeats or skips a token shows as a gap or a repeat in the positions."""
    return CHOICE_BASE * (choice + 1) + position


def logprob(version: int) -> float:
    """The fake's logprob of every token policy `version` samples: a logprob shows its policy."""
    return -float(version + 1)


class DecodingTokenizer(FakeHfTokenizer):
    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return "".join("e" if t == EOS else "t" for t in token_ids if not (skip_special_tokens and t == EOS))


class StreamingClient(FakeClient):
    """Streams one token per tick to each unfinished choice, under the policy it ran when the request
    came in. Choice c of a prompt (a turn) ends with EOS after lengths[c] tokens; a resumed request
    (n=1) is told apart by the sampled tokens that end its prompt. `on_tick(num_ticks)` runs after
    every tick (the test's updates)."""

    def __init__(
        self, lengths: list[int], on_tick: Callable[[int], None] = lambda _n: None, tick_seconds: float = 0.0
    ) -> None:
        super().__init__()
        self.lengths = lengths
        self.on_tick = on_tick
        self.tick_seconds = tick_seconds
        self.num_ticks = 0
        self.num_streaming = 0
        self.streaming_at_load: list[int] = []
        """Requests still streaming at each policy load (the gate must have stopped them all)."""

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.streaming_at_load.append(self.num_streaming)
        await super().load_lora_adapter(name, path)

    async def generate_interruptible(
        self, request: GenerateRequest, interrupt: asyncio.Event
    ) -> list[Completion]:
        self.requests.append(request)
        self.num_streaming += 1
        try:
            return await self._stream(request, interrupt)
        finally:
            self.num_streaming -= 1

    async def _stream(self, request: GenerateRequest, interrupt: asyncio.Event) -> list[Completion]:
        prompt = request.prompt_token_ids
        kept = next(i for i, t in enumerate(reversed(prompt)) if t < CHOICE_BASE)
        version = self.version
        choices = [Completion([], [], "", ABORTED) for _ in range(request.n)]
        index = [(prompt[-1] // CHOICE_BASE - 1) if kept else c for c in range(request.n)]
        budget = request.params.max_tokens
        while not interrupt.is_set():
            live = [c for c in choices if c.finish_reason == ABORTED]
            if not live:
                break
            for c, choice_index in zip(choices, index, strict=True):
                if c.finish_reason != ABORTED:
                    continue
                position = len(prompt) + len(c.token_ids)
                done = kept + len(c.token_ids) + 1 == self.lengths[choice_index]
                c.token_ids.append(EOS if done else token(choice_index, position))
                c.logprobs.append(logprob(version))
                if done:
                    c.finish_reason = "stop"
                elif budget is not None and len(c.token_ids) == budget:
                    c.finish_reason = "length"
            self.num_ticks += 1
            self.on_tick(self.num_ticks)
            await asyncio.sleep(self.tick_seconds)
        return choices


def _runner(client: StreamingClient, run_dir: Path) -> tuple[RolloutRunner, PolicyTracker]:
    gate = UpdateGate()
    policy = PolicyTracker(run_dir, client, "default", "m", update_gate=gate)  # type: ignore[arg-type]
    tokenizer = ChatTokenizer(DecodingTokenizer())
    return RolloutRunner(client, tokenizer, policy, update_gate=gate), policy  # type: ignore[arg-type]


def _update_at(ticks: dict[int, int], policy_box: list[PolicyTracker]) -> Callable[[int], None]:
    """on_tick that loads policy ticks[n] after tick n (as the policy watcher would, concurrently)."""
    tasks: list[asyncio.Task[None]] = []

    def on_tick(num_ticks: int) -> None:
        if num_ticks in ticks:
            tasks.append(asyncio.ensure_future(policy_box[0].load(ticks[num_ticks])))

    return on_tick


def _group(
    tmp_path: Path, lengths: list[int], updates: dict[int, int], params: SamplingParams, env: Any = None
) -> tuple[list[Rollout], StreamingClient]:
    box: list[PolicyTracker] = []
    client = StreamingClient(lengths, _update_at(updates, box))
    runner, policy = _runner(client, tmp_path)
    box.append(policy)
    env = env or SingleTurnEnv(examples=[{"prompt": "q", "answer": "a"}], rewards=[lambda completion: 1.0])
    req = GroupRequest(0, env, 0, env.examples[0], len(lengths), params, resume_across_updates=True)
    group = asyncio.run(runner.run_group(req))
    return group.rollouts, client


def _prompt_len(client: StreamingClient) -> int:
    return len(client.requests[0].prompt_token_ids)


def _expected(choice: int, prompt_len: int, length: int, max_tokens: int) -> tuple[list[int], str]:
    if length <= max_tokens:
        return [token(choice, prompt_len + i) for i in range(length - 1)] + [EOS], "stop"
    return [token(choice, prompt_len + i) for i in range(max_tokens)], "length"


def test_a_resumed_rollout_is_its_kept_tokens_then_the_new_ones_with_aligned_logprobs_and_versions(
    tmp_path: Path,
) -> None:
    # the update comes after 3 tokens of each; one then ends on eos, the other on the max_tokens budget
    rollouts, client = _group(tmp_path, [6, 20], {3: 1}, SamplingParams(max_tokens=10, min_tokens=5))
    prompt_len = _prompt_len(client)
    for choice, (rollout, length) in enumerate(zip(rollouts, [6, 20], strict=True)):
        ids, reason = _expected(choice, prompt_len, length, 10)
        assert rollout.completion_ids == ids  # nothing repeated or dropped at the seam, one eos
        assert rollout.truncated == (reason == "length")
        assert rollout.completion_versions == [0, 0, 0] + [1] * (len(ids) - 3)
        assert rollout.completion_logprobs == [logprob(v) for v in rollout.completion_versions]
        assert rollout.start_version == 0 and rollout.end_version == 1
        assert (rollout.num_resumes, rollout.num_recovered_tokens) == (1, 3)
        assert rollout.completion_text == "t" * (len(ids) - (reason == "stop"))  # decoded whole
    assert client.streaming_at_load == [0]  # stopped before the new weights went in
    first, *resumed = client.requests
    assert (first.n, first.params.max_tokens, first.model, first.cache_salt) == (2, 10, "m", "policy-0")
    for request in resumed:  # token in: the prompt and the kept tokens; the rest of the budgets
        choice = request.prompt_token_ids[-1] // CHOICE_BASE - 1
        assert request.prompt_token_ids == first.prompt_token_ids + [
            token(choice, prompt_len + i) for i in range(3)
        ]
        assert (request.n, request.params.max_tokens, request.params.min_tokens) == (1, 7, 2)
        assert (request.model, request.cache_salt) == ("default", "policy-1")


def test_a_choice_that_ended_in_the_chunk_before_the_update_is_not_resumed(tmp_path: Path) -> None:
    rollouts, client = _group(tmp_path, [2, 5], {2: 1}, SamplingParams(max_tokens=10))
    prompt_len = _prompt_len(client)
    assert rollouts[0].completion_ids == [token(0, prompt_len), EOS]
    assert rollouts[0].completion_versions == [0, 0] and rollouts[0].num_resumes == 0
    assert rollouts[1].completion_ids == _expected(1, prompt_len, 5, 10)[0]
    assert rollouts[1].completion_versions == [0, 0, 1, 1, 1]
    assert len(client.requests) == 2  # the first, and one resume for the unfinished choice


def test_a_rollout_resumes_at_every_update_and_its_oldest_token_sets_its_staleness(tmp_path: Path) -> None:
    rollouts, client = _group(tmp_path, [12], {2: 1, 5: 2}, SamplingParams(max_tokens=12))
    prompt_len = _prompt_len(client)
    (rollout,) = rollouts
    assert rollout.completion_ids == _expected(0, prompt_len, 12, 12)[0]
    assert rollout.completion_versions == [0, 0] + [1] * 3 + [2] * 7
    assert (rollout.num_resumes, rollout.num_recovered_tokens) == (2, 5)
    assert rollout.start_version == 0 and rollout.end_version == 2
    # batch 2 under max_off_policy_steps 1 drops it: its oldest token is two policies old
    assert rollout.start_version < oldest_acceptable(2, max_off_policy_steps=1)


def test_a_generation_started_during_an_update_waits_for_it_and_runs_under_the_new_policy(
    tmp_path: Path,
) -> None:
    client = StreamingClient([4])
    runner, policy = _runner(client, tmp_path)
    env = SingleTurnEnv(examples=[{"prompt": "q"}], rewards=[lambda completion: 1.0])
    req = GroupRequest(
        0, env, 0, env.examples[0], 1, SamplingParams(max_tokens=8), resume_across_updates=True
    )

    async def main() -> list[Rollout]:
        assert runner.resumer is not None
        async with runner.resumer.gate.update():  # an update under way when the rollout starts
            started = asyncio.ensure_future(runner.run_group(req))
            await asyncio.sleep(0.01)
            assert client.requests == []  # held until the update is done
            await client.load_lora_adapter("default", str(tmp_path / "step_1"))
            policy.version = 1
        return (await started).rollouts

    (rollout,) = asyncio.run(main())
    assert rollout.completion_versions == [1] * 4 and rollout.start_version == 1
    assert rollout.num_resumes == 0 and client.requests[0].cache_salt == "policy-1"


class GuessEnv(MultiTurnEnv):
    async def step(self, messages: list[Message], state: dict[str, Any]) -> EnvReply:
        return EnvReply([{"role": "user", "content": "again"}], done=False)


def test_a_multi_turn_rollout_resumes_the_turn_the_update_stopped(tmp_path: Path) -> None:
    env = GuessEnv(examples=[{"prompt": "q"}], rewards=[lambda completion: 1.0], max_turns=2)
    # each turn: 4 tokens ending in eos; turn 1 takes ticks 1-4, turn 2 is stopped after its 2nd (tick 6)
    box: list[PolicyTracker] = []
    client = StreamingClient([4], _update_at({6: 1}, box))
    runner, policy = _runner(client, tmp_path)
    box.append(policy)

    req = GroupRequest(
        0, env, 0, env.examples[0], 1, SamplingParams(max_tokens=8), resume_across_updates=True
    )
    (rollout,) = asyncio.run(runner.run_group(req)).rollouts
    mask = np.array(rollout.completion_mask)
    versions = np.array(rollout.completion_versions)
    model_versions = versions[mask].tolist()
    assert model_versions == [0, 0, 0, 0, 0, 0, 1, 1]  # turn 1 (4); turn 2: 2 kept, 2 resumed
    assert rollout.completion_ids[-1] == EOS and rollout.completion_ids.count(EOS) == 2
    assert (
        len(rollout.completion_versions or [])
        == len(rollout.completion_ids)
        == len(rollout.completion_logprobs)
    )
    assert [lp for lp, m in zip(rollout.completion_logprobs, mask, strict=True) if m] == [
        logprob(v) for v in model_versions
    ]
    assert (rollout.num_resumes, rollout.num_recovered_tokens) == (1, 2)


def test_evaluation_rollouts_never_stream_or_resume(tmp_path: Path) -> None:
    client = StreamingClient([4])
    runner, _policy = _runner(client, tmp_path)
    env = SingleTurnEnv(examples=[{"prompt": "q"}], rewards=[lambda completion: 1.0])
    req = GroupRequest(0, env, 0, env.examples[0], 2, SamplingParams())  # eval builds them like this
    (rollout, _) = asyncio.run(runner.run_group(req)).rollouts
    assert client.requests and client.num_ticks == 0  # the plain generate
    assert rollout.completion_versions is None


def test_a_run_with_partial_rollouts_trains_resumed_rollouts_and_counts_them(tmp_path: Path) -> None:
    cfg = OrchestratorConfig.model_validate(
        {
            "model": {"name": "base-model"},
            "batch_size": 4,
            "rollouts_per_example": 2,
            "seq_len": 128,
            "max_steps": 4,
            "max_async_level": 1,
            "partial_rollouts": True,
            "sampling": {"max_tokens": 60},
        }
    )

    client = StreamingClient([60, 8], tick_seconds=0.005)
    sender = QueueSender(maxsize=1)
    trainer = FakeTrainer(sender, tmp_path, 4, train_seconds=0.01)
    trainer.start()
    env = SingleTurnEnv(examples=[{"prompt": f"q{i}"} for i in range(8)], rewards=[lambda completion: 1.0])
    orch = Orchestrator(cfg, client, sender, tmp_path, ChatTokenizer(DecodingTokenizer()), [env])
    asyncio.run(asyncio.wait_for(orch.run(), timeout=60))
    trainer.join(timeout=30)
    assert trainer.error is None
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert sum(row["partial/num_resumed_rollouts"] for row in rows) > 0
    assert sum(row["partial/num_recovered_tokens"] for row in rows) > 0
    for batch in trainer.received:
        for row in batch.rows:  # every loss token trains with the logprob of the policy that sampled it
            versions = -row.inference_logprobs[row.loss_mask] - 1
            assert versions.max() <= batch.step
