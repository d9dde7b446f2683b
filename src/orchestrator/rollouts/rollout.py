"""Generating one group: prompt tokens -> inference -> (environment turns) -> scores."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from grpo.envs.base import Environment, EnvReply, Example, GroupScoring, Message, Score
from grpo.envs.rewards import FailureLog
from grpo.envs.tool_env import ToolUse, tool_schemas
from grpo.envs.tools import ToolCall
from grpo.inference.types import GenerateRequest, RolloutClient, SamplingParams
from grpo.orchestrator.images.prompt import ImagePrompt, ImagePrompter, image_parts
from grpo.orchestrator.rollouts.partial import Resumed, ResumingGenerator, UpdateGate
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.orchestrator.rollouts.tool_calls import ToolCallParser
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.orchestrator.types import Group, Rollout
from grpo.transport.batches.batch import compact_routing
from grpo.utils.errors import UserError

T = TypeVar("T")


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
    resume_across_updates: bool = False
    """partial_rollouts (training rollouts only): generation stopped at a policy update resumes
    under the new policy; needs the runner's update gate."""


class RolloutRunner:
    def __init__(
        self,
        client: RolloutClient,
        tokenizer: ChatTokenizer,
        policy: PolicyTracker,
        teacher_client: RolloutClient | None = None,
        update_gate: UpdateGate | None = None,
        seq_len: int | None = None,
        tool_parser: ToolCallParser | None = None,
        image_prompter: ImagePrompter | None = None,
    ) -> None:
        self.client = client
        self.image_prompter = image_prompter
        """Renders prompts with image parts (vision-language policies); None: text prompts only."""
        self.tool_parser = tool_parser
        """Reads tool calls from model turns; needed by environments with tools."""
        self.seq_len = seq_len
        self.tokenizer = tokenizer
        self.policy = policy
        self.teacher_client = teacher_client or client
        self.failures = FailureLog()
        self.resumer = (
            None
            if update_gate is None
            else ResumingGenerator(
                client, update_gate, lambda: policy.version, self._request, tokenizer.decode
            )
        )

    async def _env_call(
        self, env: Environment, what: str, fn: Callable[..., Awaitable[T]], *args: Any
    ) -> tuple[T | None, str | None]:
        """(result, None), or (None, reason) when the environment raised: an environment is user
        code (or a remote server) and its breaking must fail one rollout, never the run."""
        try:
            return await fn(*args), None
        except Exception as exc:
            reason = f"env {env.name}: {what} raised {type(exc).__name__}"
            self.failures.record(env.name, reason, f"{reason}: {exc}")
            return None, reason

    def _bad_reward(self, env: Environment, reward: object) -> str | None:
        """Why `reward` cannot train (NaN, inf, not a number), or None: NaN would spread through the
        group's advantages into the loss."""
        try:
            if math.isfinite(float(reward)):  # type: ignore[arg-type]
                return None
        except (TypeError, ValueError):
            pass
        reason = f"env {env.name}: reward {reward!r} is not a finite number"
        self.failures.record(env.name, reason, reason)
        return reason

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
        self,
        req: GroupRequest,
        rollout: Rollout,
        completion: list[Message],
        state: Any,
        failure: str | None = None,
        score: Score | None = None,
    ) -> Rollout:
        """Score the rollout (unless `score` came with it from its group's score_group), then fetch
        the teacher's logprobs."""
        if failure is None and not req.skip_verification:
            if score is None:
                score, failure = await self._env_call(
                    req.env, "score", req.env.score, req.example, completion, state
                )
            if score is not None and failure is None:
                failure = score.failure or self._bad_reward(req.env, score.reward)
            if score is not None and failure is None:
                # the score rewards the rollout's end: its last turn
                rollout.turn_rewards[-1] += float(score.reward)
                rollout.reward_metrics = score.metrics
        if failure is not None:
            rollout.fail(failure)
        else:
            rollout.reward = math.fsum(rollout.turn_rewards)
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

    def _resumes(self, req: GroupRequest) -> bool:
        return req.resume_across_updates and self.resumer is not None

    async def _generate(
        self, req: GroupRequest, prompt_ids: list[int], n: int, session: str | None
    ) -> list[Resumed]:
        """`n` completions of `prompt_ids`; resumed across policy updates when the request asks."""
        params = self._bounded(req.params, len(prompt_ids))
        if self._resumes(req):
            assert self.resumer is not None
            return await self.resumer.generate(prompt_ids, params, n, session)
        version = self.policy.version
        completions = await self.client.generate(self._request(prompt_ids, params, n, session))
        return [Resumed(c, [version] * len(c.token_ids), version) for c in completions]

    async def _generate_images(self, req: GroupRequest, prompt: ImagePrompt) -> list[Resumed]:
        """`req.num_rollouts` completions of an image prompt: vLLM is sent one placeholder per image
        with the images, and must have run the prompt the trainer will see (`prompt.ids`)."""
        assert not self._resumes(req), "image_prompter_for refuses partial_rollouts with image prompts"
        params = self._bounded(req.params, len(prompt.ids))
        version = self.policy.version
        request = replace(
            self._request(prompt.request_ids, params, req.num_rollouts, None), image_urls=prompt.image_urls
        )
        completions = await self.client.generate(request)
        for completion in completions:
            if completion.prompt_token_ids != prompt.ids:
                ran = completion.prompt_token_ids or []
                raise RuntimeError(
                    f"vLLM ran the image prompt as {len(ran)} tokens where the model's image processor gives "
                    f"{len(prompt.ids)}: the server and the orchestrator process images differently (check that "
                    "both load the same model folder)"
                )
        return [Resumed(c, [version] * len(c.token_ids), version) for c in completions]

    def _image_prompt(self, req: GroupRequest, messages: list[Message]) -> ImagePrompt | None:
        """The prompt of messages with image parts; None for a text prompt."""
        if not image_parts(messages):
            return None
        if self.image_prompter is None:
            raise UserError(
                f"env {req.env.name}: its prompts have images, but the policy is not a vision-language "
                "model the orchestrator can render them for (Qwen2-VL, Qwen2.5-VL)"
            )
        # image_prompter_for refused the rest at load
        assert req.teacher_model is None and req.env.max_turns == 1 and not isinstance(req.env, ToolUse)
        return self.image_prompter.prompt(messages)

    def _bounded(self, params: SamplingParams, num_context_tokens: int) -> SamplingParams:
        """`params` with a null max_tokens made the room left in seq_len: vLLM reads a null max_tokens
        as 16 tokens, and tokens past seq_len are truncated before training anyway."""
        if params.max_tokens is not None or self.seq_len is None:
            return params
        return replace(params, max_tokens=max(1, self.seq_len - num_context_tokens))

    def _rollout(self, req: GroupRequest, prompt_ids: list[int], choice: Resumed, start: int) -> Rollout:
        c = choice.completion
        resumes = self._resumes(req)
        return Rollout(
            env_name=req.env.name,
            example_index=req.example_index,
            prompt_ids=prompt_ids,
            completion_ids=list(c.token_ids),
            completion_mask=[True] * len(c.token_ids),
            completion_logprobs=list(c.logprobs),
            temperature=req.params.temperature,
            # resumed: the first request's version, its oldest tokens'
            start_version=choice.start_version if resumes else start,
            end_version=self.policy.version,
            completion_text=c.text,
            truncated=c.finish_reason == "length",
            completion_versions=list(choice.versions) if resumes else None,
            num_resumes=choice.num_resumes,
            num_recovered_tokens=choice.num_recovered_tokens,
            routed_experts=None
            if c.routed_experts is None
            else compact_routing(c.routed_experts, len(prompt_ids) + len(c.token_ids)),
            kept_counts=_own_kept_counts(choice),
        )

    async def run_group(self, req: GroupRequest) -> Group:
        messages = req.env.prompt_messages(req.example)
        image_prompt = self._image_prompt(req, messages)
        if image_prompt is None:
            prompt_ids = self.tokenizer.prompt_ids(messages, tool_schemas(req.env))
        else:
            prompt_ids = image_prompt.ids
        if req.env.max_turns == 1:
            start = self.policy.version
            if image_prompt is None:
                choices = await self._generate(req, prompt_ids, req.num_rollouts, None)
            else:
                choices = await self._generate_images(req, image_prompt)
            rollouts = [self._rollout(req, prompt_ids, c, start) for c in choices]
            for rollout in rollouts:
                rollout.prompt_images = None if image_prompt is None else image_prompt.images
            texts = [[{"role": "assistant", "content": c.completion.text}] for c in choices]
            if self._scores_each(req):
                done = await asyncio.gather(
                    *(self._reset_and_finish(req, r, t) for r, t in zip(rollouts, texts, strict=True))
                )
            else:
                resets = [
                    await self._env_call(req.env, "reset", req.env.reset, req.example) for _ in rollouts
                ]
                scores = await self._group_scores(req, rollouts, texts, [failure for _, failure in resets])
                done = await asyncio.gather(
                    *(
                        self._finish(req, r, t, state, failure, score)
                        for r, t, (state, failure), score in zip(rollouts, texts, resets, scores, strict=True)
                    )
                )
        elif self._scores_each(req):
            done = await asyncio.gather(
                *(self._play_and_finish(req, messages, prompt_ids, i) for i in range(req.num_rollouts))
            )
        else:
            played = await asyncio.gather(
                *(self._multi_turn(req, messages, prompt_ids, i) for i in range(req.num_rollouts))
            )
            rollouts = [rollout for rollout, _, _, _ in played]
            completions = [completion for _, completion, _, _ in played]
            scores = await self._group_scores(req, rollouts, completions, [failure for *_, failure in played])
            done = await asyncio.gather(
                *(
                    self._finish(req, r, c, state, failure, score)
                    for (r, c, state, failure), score in zip(played, scores, strict=True)
                )
            )
        return Group(req.env_index, req.example, req.example_index, list(done))

    @staticmethod
    def _scores_each(req: GroupRequest) -> bool:
        """Rollouts are scored one by one (not by score_group): each goes from its reset to its score
        on its own, so an environment holding a server session per rollout (OpenEnv, max_sessions)
        frees it once that rollout is scored, not once its whole group has played; holding them
        for the group would wait forever wherever a group needs more sessions than there are."""
        return not isinstance(req.env, GroupScoring) or req.skip_verification

    async def _reset_and_finish(self, req: GroupRequest, rollout: Rollout, text: list[Message]) -> Rollout:
        state, failure = await self._env_call(req.env, "reset", req.env.reset, req.example)
        return await self._finish(req, rollout, text, state, failure)

    async def _play_and_finish(
        self, req: GroupRequest, messages: list[Message], prompt_ids: list[int], index: int
    ) -> Rollout:
        rollout, completion, state, failure = await self._multi_turn(req, messages, prompt_ids, index)
        return await self._finish(req, rollout, completion, state, failure)

    async def _group_scores(
        self,
        req: GroupRequest,
        rollouts: list[Rollout],
        completions: list[list[Message]],
        failures: list[str | None],
    ) -> list[Score | None]:
        """Each rollout's Score from one score_group call over the rollouts that can be scored, when
        the environment scores groups; else None for each (then _finish scores them one by one)."""
        if not isinstance(req.env, GroupScoring) or req.skip_verification:
            return [None] * len(rollouts)
        live = [i for i, failure in enumerate(failures) if failure is None]
        scores: list[Score | None] = [None] * len(rollouts)
        if not live:
            return scores
        group, failure = await self._env_call(
            req.env,
            "score_group",
            req.env.score_group,
            req.example,
            [completions[i] for i in live],
            [_model_ids(rollouts[i]) for i in live],
        )
        if group is not None and len(group) != len(live):
            failure = f"env {req.env.name}: score_group returned {len(group)} scores for {len(live)} rollouts"
            self.failures.record(req.env.name, failure, failure)
        for k, i in enumerate(live):
            scores[i] = (
                Score(reward=0.0, failure=failure) if failure is not None or group is None else group[k]
            )
        return scores

    async def _multi_turn(
        self, req: GroupRequest, messages: list[Message], prompt_ids: list[int], index: int
    ) -> tuple[Rollout, list[Message], Any, str | None]:
        """One rollout's turns, not yet scored: (rollout, completion messages, state, failure)."""
        history = [dict(m) for m in messages]
        state, failure = await self._env_call(req.env, "reset", req.env.reset, req.example)
        start = self.policy.version
        session = f"{req.env.name}#{req.env_index}-{req.example_index}-{index}-{id(state)}"
        try:
            rollout, completion, failure = await self._turns(
                req, history, prompt_ids, state, start, session, failure
            )
        finally:
            # The client keeps each session's server (sticky routing) until told the session ended.
            self.client.end_session(session)
        return rollout, completion, state, failure

    async def _turns(
        self,
        req: GroupRequest,
        history: list[Message],
        prompt_ids: list[int],
        state: Any,
        start: int,
        session: str,
        failure: str | None,
    ) -> tuple[Rollout, list[Message], str | None]:
        """The model/environment turns of one rollout; an environment failure ends them early. With
        tools, a turn's tool calls are run and their results are the next context; a turn without
        calls goes to the environment's step."""
        tools = tool_schemas(req.env)
        # a prompt ending in an assistant message is that turn's start (the model continues it)
        prefill = str(history.pop()["content"]) if history and history[-1].get("role") == "assistant" else ""
        rollout: Rollout | None = None
        completion: list[Message] = []
        for turn in range(req.env.max_turns):
            context = prompt_ids if rollout is None else prompt_ids + rollout.completion_ids
            (choice,) = await self._generate(req, context, 1, session)
            c = choice.completion
            if rollout is None:
                rollout = self._rollout(req, prompt_ids, choice, start)
            else:
                rollout.turn_starts.append(len(rollout.completion_ids))
                rollout.turn_rewards.append(0.0)
                _extend_kept_counts(rollout, _own_kept_counts(choice), len(c.token_ids))
                rollout.completion_ids += c.token_ids
                rollout.completion_mask += [True] * len(c.token_ids)
                rollout.completion_logprobs += c.logprobs
                rollout.completion_text += c.text
                rollout.truncated = c.finish_reason == "length"
                rollout.end_version = self.policy.version
                if rollout.completion_versions is not None:
                    rollout.completion_versions += choice.versions
                rollout.num_resumes += choice.num_resumes
                rollout.num_recovered_tokens += choice.num_recovered_tokens
            reply_msg: Message = {"role": "assistant", "content": prefill + c.text}
            calls = self._tool_calls(list(c.token_ids), context, tools, prefill)
            prefill = ""
            if calls:
                reply_msg["tool_calls"] = [_openai_call(call) for call in calls]
            history.append(reply_msg)
            completion.append(reply_msg)
            # a turn cut at max_tokens still runs the calls it made (as vLLM's chat route parses them)
            if failure is not None or (rollout.truncated and not calls) or turn == req.env.max_turns - 1:
                break
            if calls:
                assert isinstance(req.env, ToolUse)
                new_messages = await self._run_tools(req.env, calls, rollout)
            else:
                reply: EnvReply | None
                reply, failure = await self._env_call(req.env, "step", req.env.step, history, state)
                if reply is not None and reply.reward is not None:
                    failure = self._bad_reward(req.env, reply.reward)
                    if failure is None:
                        rollout.turn_rewards[-1] += float(reply.reward)
                if failure is not None or reply is None or reply.done:
                    break
                new_messages = reply.messages
            if rollout.truncated or isinstance(c.stop_reason, str):
                # a turn cut at max_tokens or by a stop string lacks the end of turn the model would have
                # sampled: close it as the template would, with a token that never trains
                self._append_env_ids(rollout, self.tokenizer.encode(self.tokenizer.end_of_turn_token))
            self._append_env_ids(rollout, self.tokenizer.continuation_ids(history, new_messages, tools))
            history += new_messages
            completion += new_messages
        assert rollout is not None  # max_turns >= 1
        return rollout, completion, failure

    def _append_env_ids(self, rollout: Rollout, env_ids: list[int]) -> None:
        """Tokens the model did not sample (environment and tool turns): in the context, never trained."""
        _extend_kept_counts(rollout, None, len(env_ids))
        rollout.completion_ids += env_ids
        rollout.completion_mask += [False] * len(env_ids)
        rollout.completion_logprobs += [0.0] * len(env_ids)
        if rollout.completion_versions is not None:
            rollout.completion_versions += [self.policy.version] * len(env_ids)

    def _tool_calls(
        self, token_ids: list[int], context: list[int], tools: list[dict[str, Any]] | None, prefill: str
    ) -> list[ToolCall]:
        if not tools:
            return []
        assert self.tool_parser is not None, "an environment with tools needs the runner's tool_parser"
        return self.tool_parser.parse(token_ids, context, tools, prefill)

    async def _run_tools(self, env: ToolUse, calls: list[ToolCall], rollout: Rollout) -> list[Message]:
        """The calls' tool messages, run one after another (tools may share state, e.g. a sandbox)."""
        messages = []
        for call in calls:
            result = await env.tools.run(call)
            rollout.num_tool_calls += 1
            rollout.num_tool_errors += result.error
            messages.append(result.message)
        return messages


def _openai_call(call: ToolCall) -> dict[str, Any]:
    """A parsed call as an assistant message's tool_calls entry (OpenAI's format)."""
    entry: dict[str, Any] = {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if call.id is not None:
        entry["id"] = call.id
    return entry


def _model_ids(rollout: Rollout) -> list[int]:
    """The tokens the model sampled (environment and tool turns left out)."""
    return [t for t, m in zip(rollout.completion_ids, rollout.completion_mask, strict=True) if m]


def _own_kept_counts(choice: Resumed) -> np.ndarray | None:
    """The engine's kept counts for every token of `choice`; None for a resumed one, whose tokens
    came from several requests while the last one's counts cover only its own."""
    return choice.completion.kept_counts if choice.num_resumes == 0 else None


def _extend_kept_counts(rollout: Rollout, counts: np.ndarray | None, num_tokens: int) -> None:
    """Extend the rollout's kept_counts (one per completion token, or None) by the `num_tokens`
    tokens about to be appended: their engine counts, or 0 (the trainer's truncation rules) where
    the engine reported none, as for environment tokens, which are never sampled or trained."""
    if rollout.kept_counts is None and counts is None:
        return
    before = len(rollout.completion_ids)
    kept = rollout.kept_counts if rollout.kept_counts is not None else np.zeros(before, np.int32)
    added = counts if counts is not None else np.zeros(num_tokens, np.int32)
    assert len(kept) == before and len(added) == num_tokens
    rollout.kept_counts = np.concatenate([kept, added]).astype(np.int32, copy=False)
