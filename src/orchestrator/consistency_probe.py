"""The orchestrator's half of the consistency check (orch `consistency_check`): the engine's
distributions at every position of a few fresh completions, for the trainer to compare with its own.

The trainer computes batch n with policy n, so the probe must come from an engine running exactly
policy n: at a check step the orchestrator waits for it before it sends the batch (the engine cannot
move past it, since the trainer needs this batch first). The completions are sampled fresh rather
than taken from the batch, whose rollouts older policies may have sampled, so the kept-set sizes a
grpo CPU engine reports with each token are those of policy n too.

Per probed prompt, three requests:
1. the engine renders the prompt's messages with its own chat template (`render_chat_prompt`);
2. one completion of the orchestrator's prompt ids, with the step's sampling settings;
3. the engine's top tokens at every position of its own prompt + that completion (prompt logprobs).
The trainer computes on the orchestrator's prompt + the completion. When the two renderings agree
the contexts are the same tokens; when they do not, the divergences show what the orchestrator's
rendering does to the model's next-token distributions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from grpo.config.sections.consistency import ConsistencyCheckConfig
from grpo.envs.base import Environment, non_text_parts
from grpo.envs.tool_env import tool_schemas
from grpo.inference.types import GenerateRequest, RolloutClient, SamplingParams
from grpo.orchestrator.rollouts.tokenizer import ChatTokenizer
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.orchestrator.types import Group
from grpo.transport.batches.probe import ConsistencyProbe, ProbeSequence
from grpo.utils.errors import UserError
from grpo.utils.logging import get_logger

log = get_logger("orchestrator")


def is_check_step(cfg: ConsistencyCheckConfig, step: int) -> bool:
    return cfg.interval is not None and step % cfg.interval == 0


async def take_probe(
    cfg: ConsistencyCheckConfig,
    client: RolloutClient,
    tokenizer: ChatTokenizer,
    envs: list[Environment],
    groups: list[Group],
    params: SamplingParams,
    policy: PolicyTracker,
) -> ConsistencyProbe | None:
    """Probe the text prompts of the first `cfg.num_samples` groups under the policy the servers
    run (None when none has one)."""
    policy_version = policy.version
    sequences: list[ProbeSequence] = []
    for group in groups:
        if len(sequences) == cfg.num_samples:
            break
        env = envs[group.env_index]
        messages = env.prompt_messages(group.example)
        if non_text_parts(messages):
            continue
        sequence = await _probe_prompt(
            cfg, client, tokenizer, list(messages), tool_schemas(env), params, policy
        )
        if sequence is not None:
            sequences.append(sequence)
    if not sequences:
        log.warning(
            "consistency check at policy %d: no text prompt with a completion to probe", policy_version
        )
        return None
    return ConsistencyProbe(policy_version=policy_version, sequences=sequences, warn_kl=cfg.warn_kl)


async def _probe_prompt(
    cfg: ConsistencyCheckConfig,
    client: RolloutClient,
    tokenizer: ChatTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    params: SamplingParams,
    policy: PolicyTracker,
) -> ProbeSequence | None:
    model = policy.model_name
    prompt_ids = tokenizer.prompt_ids(messages, tools)
    engine_prompt_ids = await client.render_chat_prompt(messages, model, tools, tokenizer.template_kwargs)
    max_tokens = min(params.max_tokens or cfg.max_tokens, cfg.max_tokens)
    request = GenerateRequest(
        prompt_token_ids=prompt_ids,
        params=replace(params, max_tokens=max_tokens),
        model=model,
        cache_salt=policy.cache_salt,
    )
    (completion,) = await client.generate(request)
    completion_ids = list(completion.token_ids)
    if not completion_ids:
        return None
    try:
        entries = await client.prompt_top_logprobs(
            engine_prompt_ids + completion_ids, model, cfg.top_logprobs
        )
    except RuntimeError as refused:
        if "HTTP 400" not in str(refused):
            raise
        # vLLM refuses more logprobs per position than its --max-logprobs (20 unless set)
        raise UserError(
            f"the inference server refused consistency_check.top_logprobs {cfg.top_logprobs} ({refused}); start it "
            f"with max_logprobs: {cfg.top_logprobs} in infer.yaml, or lower top_logprobs"
        ) from None
    top_ids, top_logprobs = top_arrays(entries[len(engine_prompt_ids) :], cfg.top_logprobs)
    return ProbeSequence(
        input_ids=np.asarray(prompt_ids + completion_ids, dtype=np.int32),
        num_prompt_tokens=len(prompt_ids),
        engine_top_ids=top_ids,
        engine_top_logprobs=top_logprobs,
        temperature=params.temperature,
        engine_prompt_matches=engine_prompt_ids == prompt_ids,
        engine_kept_counts=completion.kept_counts,
    )


def top_arrays(entries: list[dict[int, float] | None], num_top: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt-logprob entries (token -> logprob, one per position) -> ([P, K] int32 ids, [P, K]
    float32 logprobs), most likely first. K is `num_top` (-1: every token the entries hold), or
    fewer where an entry holds fewer; the extra entry vLLM adds for a position's own token when it
    is not among the top ones is dropped with the rest past K."""
    if any(entry is None for entry in entries):
        raise RuntimeError("the server left out prompt logprobs of a completion position")
    ranked = [sorted(entry.items(), key=lambda item: -item[1]) for entry in entries if entry is not None]
    k = min(len(items) for items in ranked)
    if num_top > 0:
        k = min(k, num_top)
    ids = np.asarray([[token for token, _ in items[:k]] for items in ranked], dtype=np.int32)
    logprobs = np.asarray([[lp for _, lp in items[:k]] for items in ranked], dtype=np.float32)
    return ids.reshape(len(ranked), k), logprobs.reshape(len(ranked), k)
