"""orch.yaml `sampling` -> what each completion request carries, and its --dry-run description."""

from __future__ import annotations

import dataclasses
import json

import yaml

from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.sections.sampling import SamplingConfig, TempSchedulerConfig
from grpo.inference.types import SamplingParams
from grpo.orchestrator.rollouts.sampling import describe_sampling, request_sampling


def test_every_sampling_key_reaches_the_request() -> None:
    # Values the config refuses, built unchecked: a key mapped to a constant would not show here.
    values = {
        "max_tokens": 7,
        "min_tokens": 2,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.3,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "include_stop_str_in_output": True,
    }
    cfg = SamplingConfig.model_construct(
        **values, temperature=0.5, temp_scheduler=None, seed=100, stop=["</a>"], stop_token_ids=[2, 3]
    )
    params = request_sampling(cfg, step=0, max_steps=10, num_groups_launched=3)
    assert {name: getattr(params, name) for name in values} == values
    assert (params.stop, params.stop_token_ids) == (("</a>",), (2, 3))
    assert (params.temperature, params.seed) == (0.5, 103)
    keys = set(SamplingConfig.model_fields) - {"temperature", "temp_scheduler"}
    assert keys <= {f.name for f in dataclasses.fields(SamplingParams)}, "a sampling key no request carries"


def test_the_temperature_follows_the_schedule() -> None:
    schedule = TempSchedulerConfig(type="linear", start_temperature=1.0, end_temperature=0.5)
    cfg = SamplingConfig(temp_scheduler=schedule)
    assert [request_sampling(cfg, step, 11, 0).temperature for step in (0, 10)] == [1.0, 0.5]


def test_dry_run_shows_every_setting_each_request_carries_as_yaml_comments() -> None:
    schedule = {"type": "cosine", "start_temperature": 1.0, "end_temperature": 0.25}
    cfg = OrchestratorConfig.model_validate(
        {"max_steps": 5, "sampling": {"temp_scheduler": schedule, "seed": 4}}
    )
    text = describe_sampling(cfg)
    assert yaml.safe_load(text) is None  # only comments: the resolved YAML around it still parses
    carried = json.loads(text.splitlines()[1].removeprefix("# "))
    assert {f.name for f in dataclasses.fields(SamplingParams)} <= set(carried)
    assert (carried["temperature"], carried["top_k"], carried["top_p"], carried["seed"]) == (1.0, 0, 1.0, 4)
    assert "--generation-config vllm" in text and "1 at step 0 to 0.25 at the last step" in text


def test_dry_run_shows_the_stop_settings_and_which_text_the_rewards_score() -> None:
    sampling = {"stop": ["</answer>"], "stop_token_ids": [7], "include_stop_str_in_output": True}
    text = describe_sampling(OrchestratorConfig.model_validate({"sampling": sampling}))
    carried = json.loads(text.splitlines()[1].removeprefix("# "))
    assert (carried["stop"], carried["stop_token_ids"], carried["include_stop_str_in_output"]) == (
        ["</answer>"],
        [7],
        True,
    )
    assert 'stop: ["</answer>"], stop_token_ids: [7]' in text and "keeps the stop string" in text
    assert "stop:" not in describe_sampling(OrchestratorConfig())
