"""orch.yaml `sampling` -> the sampling settings each completion request carries, and their
description for `--dry-run`."""

from __future__ import annotations

import json

from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.sections.sampling import SamplingConfig
from grpo.inference.completion_bodies import sampling_fields
from grpo.inference.types import SamplingParams


def request_sampling(
    cfg: SamplingConfig, step: int, max_steps: int | None, num_groups_launched: int
) -> SamplingParams:
    """The sampling settings of the next group launched for `step` (each group its own seed)."""
    return SamplingParams(
        temperature=cfg.temperature_at(step, max_steps),
        max_tokens=cfg.max_tokens,
        min_tokens=cfg.min_tokens,
        repetition_penalty=cfg.repetition_penalty,
        presence_penalty=cfg.presence_penalty,
        frequency_penalty=cfg.frequency_penalty,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        min_p=cfg.min_p,
        seed=None if cfg.seed is None else cfg.seed + num_groups_launched,
        stop=tuple(cfg.stop),
        stop_token_ids=tuple(cfg.stop_token_ids),
        include_stop_str_in_output=cfg.include_stop_str_in_output,
    )


def describe_sampling(cfg: OrchestratorConfig) -> str:
    """What every completion request of the run states, as the body carries it; YAML comment lines,
    so the --dry-run output around them still parses."""
    fields = sampling_fields(request_sampling(cfg.sampling, 0, cfg.max_steps, 0))
    lines = [
        "# ---- sampling each completion request states (none is left to a server default; grpo's "
        "vLLM servers also run with --generation-config vllm) ----",
        f"# {json.dumps(fields)}",
    ]
    if cfg.sampling.temp_scheduler is not None:
        last = cfg.sampling.temperature_at(cfg.max_steps or 0, cfg.max_steps)
        lines.append(f"# temperature: {fields['temperature']:g} at step 0 to {last:g} at the last step")
    if cfg.sampling.seed is not None:
        lines.append("# seed: sampling.seed + the index of the group in launch order")
    if cfg.sampling.stop or cfg.sampling.stop_token_ids:
        kept = "keeps" if cfg.sampling.include_stop_str_in_output else "drops"
        lines.append(
            f"# stop: {json.dumps(cfg.sampling.stop)}, stop_token_ids: {cfg.sampling.stop_token_ids}; the "
            f"text rewards score {kept} the stop string, the tokens that train are every token sampled"
        )
    return "\n".join(lines)
