"""Generating one group: prompt tokens -> inference -> (environment turns) -> scores."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from grpo.envs.base import Environment, Example, Message
from grpo.inference.types import Completion, GenerateRequest, RolloutClient, SamplingParams
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.orchestrator.tokenizer import ChatTokenizer
from grpo.orchestrator.types import Group, Rollout


@dataclass
class GroupRequest:
    env_index: int
    env: Environment
    example_index: int
    example: Example
    num_rollouts: int
    params: SamplingParams
    skip_verification: bool = False
    teacher_model: str | None = None
    """Served name of the teacher; None = no teacher logprobs."""


class RolloutRunner:
    def __init__(
        self,
        client: RolloutClient,
        tokenizer: ChatTokenizer,
        policy: PolicyTracker,
        teacher_client: RolloutClient | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.policy = policy
        self.teacher_client = teacher_client or client

    def _request(
        self, prompt_ids: list[int], params: SamplingParams, n: int, session: str | None
    ) -> GenerateRequest:
        return GenerateRequest(
            prompt_token_ids=prompt_ids,
            params=params,
            n=n,
            model=self.policy.model_name,
            cache_salt=self.policy.cache_salt,
            session_id=session,
        )

    async def _finish(
        self, req: GroupRequest, rollout: Rollout, completion: list[Message], state: dict
    ) -> Rollout:
        if not req.skip_verification:
            score = await req.env.score(req.example, completion, state)
            rollout.reward, rollout.failure, rollout.reward_metrics = (
                score.reward,
                score.failure,
                score.metrics,
            )
        if req.teacher_model is not None:
            ids = rollout.prompt_ids + rollout.completion_ids
            teacher = await self.teacher_client.prompt_logprobs(ids, req.teacher_model)
            if len(teacher) != len(ids):
                raise RuntimeError(
                    f"teacher server returned {len(teacher)} prompt logprobs for {len(ids)} tokens "
                    f"(model {req.teacher_model}); it must score every token it is given"
                )
            rollout.teacher_logprobs = teacher
        return rollout

    def _rollout(self, req: GroupRequest, prompt_ids: list[int], c: Completion, start: int) -> Rollout:
        return Rollout(
            env_name=req.env.name,
            example_index=req.example_index,
            prompt_ids=prompt_ids,
            completion_ids=list(c.token_ids),
            completion_mask=[True] * len(c.token_ids),
            completion_logprobs=list(c.logprobs),
            temperature=req.params.temperature,
            start_version=start,
            end_version=self.policy.version,
            completion_text=c.text,
            truncated=c.finish_reason == "length",
        )

    async def run_group(self, req: GroupRequest) -> Group:
        messages = req.env.prompt_messages(req.example)
        prompt_ids = self.tokenizer.prompt_ids(messages)
        if req.env.max_turns == 1:
            start = self.policy.version
            completions = await self.client.generate(
                self._request(prompt_ids, req.params, req.num_rollouts, None)
            )
            rollouts = [self._rollout(req, prompt_ids, c, start) for c in completions]
            states: list[dict] = [await req.env.reset(req.example) for _ in rollouts]
            texts = [[{"role": "assistant", "content": c.text}] for c in completions]
            done = await asyncio.gather(
                *(self._finish(req, r, t, s) for r, t, s in zip(rollouts, texts, states, strict=True))
            )
        else:
            done = await asyncio.gather(
                *(self._multi_turn(req, messages, prompt_ids, i) for i in range(req.num_rollouts))
            )
        return Group(req.env.name, req.example, req.example_index, list(done))

    async def _multi_turn(
        self, req: GroupRequest, messages: list[Message], prompt_ids: list[int], index: int
    ) -> Rollout:
        history = [dict(m) for m in messages]
        state = await req.env.reset(req.example)
        start = self.policy.version
        session = f"{req.env.name}-{req.example_index}-{index}-{id(state)}"
        rollout: Rollout | None = None
        completion: list[Message] = []
        for turn in range(req.env.max_turns):
            context = prompt_ids if rollout is None else prompt_ids + rollout.completion_ids
            (c,) = await self.client.generate(self._request(context, req.params, 1, session))
            if rollout is None:
                rollout = self._rollout(req, prompt_ids, c, start)
            else:
                rollout.completion_ids += c.token_ids
                rollout.completion_mask += [True] * len(c.token_ids)
                rollout.completion_logprobs += c.logprobs
                rollout.completion_text += c.text
                rollout.truncated = c.finish_reason == "length"
                rollout.end_version = self.policy.version
            reply_msg = {"role": "assistant", "content": c.text}
            history.append(reply_msg)
            completion.append(reply_msg)
            if rollout.truncated or turn == req.env.max_turns - 1:
                break
            reply = await req.env.step(history, state)
            if reply.done:
                break
            env_ids = self.tokenizer.continuation_ids(history, reply.messages)
            history += reply.messages
            completion += reply.messages
            rollout.completion_ids += env_ids
            rollout.completion_mask += [False] * len(env_ids)
            rollout.completion_logprobs += [0.0] * len(env_ids)
        assert rollout is not None  # max_turns >= 1
        return await self._finish(req, rollout, completion, state)
