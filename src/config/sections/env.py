"""One `env:` entry of orch.yaml (and of eval.env): an environment by id, or an OpenEnv server by
URL. The dataset-with-reward-functions kind is in grpo.config.sections.dataset_env; `EnvBlock` is either."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, model_validator

from grpo.config.sections.dataset_env import ENV_BLOCK_TAGS, DatasetEnvConfig, env_block_kind
from grpo.config.sections.judges import ExtraRewardsConfig
from grpo.config.sections.tool_use import ToolUseConfig

OPENENV_PREFIX = "openenv:"
"""`id: "openenv:http://HOST:PORT"` names a running OpenEnv environment server (grpo.envs.openenv_env)."""


class EnvConfig(ToolUseConfig, ExtraRewardsConfig):
    id: str
    """Built-in environment id (reverse-text, short-answer, long-brief, math, count-shapes (image
    prompts, for a Qwen2-VL, Qwen2.5-VL or Idefics3 policy),
    reasoning-gym:<dataset>, e.g. reasoning-gym:chain_sum), an import path
    "pkg.module:load_environment" whose function returns an environment, a verifiers environment
    id (an installed or importable taskset package, verifiers >= 0.4), or
    "openenv:http://HOST:PORT", a running OpenEnv environment server (its args: grpo.config.sections.openenv)."""

    name: str | None = None
    """Human-readable name used in metrics (defaults to id, `openenv` for an openenv: id); environments sharing one are told apart
    by their index in the list (`reverse-text#0`, `reverse-text#1`)."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment's loader."""

    address: str | None = None
    """Address (host:port) of an external environment server; null runs the environment in-process."""

    request_timeout_s: float = Field(600, gt=0)
    """(address or openenv:) Deadline of one request to the environment server, from sending it to the reply's
    last byte however slowly the server sends it; a later reply fails its rollout (masked and
    counted, training goes on). Scoring runs the server's reward functions, which may be slow."""

    max_reply_mib: float = Field(64, gt=0)
    """(address or openenv:) Largest reply accepted from the environment server, in MiB (counted as it
    arrives); a larger one fails its rollout, or the load for the /info reply (the examples and
    their prompts)."""

    @model_validator(mode="after")
    def _tools_run_in_process(self) -> EnvConfig:
        if self.tools and self.address is not None:
            raise ValueError(
                "tools run in the orchestrator's process, an environment at address runs elsewhere; give "
                "the tools to that server's environment, or remove tools"
            )
        return self

    @property
    def display_name(self) -> str:
        if self.name is None and self.id.startswith(OPENENV_PREFIX):
            return "openenv"  # a URL would make awkward metric names
        return self.name or self.id

    @model_validator(mode="after")
    def _openenv_url(self) -> EnvConfig:
        if not self.id.startswith(OPENENV_PREFIX):
            return self
        from urllib.parse import urlsplit

        url = self.id[len(OPENENV_PREFIX) :]
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.hostname or port is None:
            raise ValueError(
                f"env id {self.id!r}: an OpenEnv server is named by its URL with scheme and port, "
                'like "openenv:http://127.0.0.1:8001"'
            )
        if parts.query or parts.fragment or parts.path.strip("/"):
            raise ValueError(
                f"env id {self.id!r}: give the server's base URL only (no path or query); its /ws endpoint is "
                "found from there"
            )
        if self.address is not None:
            raise ValueError(
                f"env {self.display_name}: an openenv: id holds its server's URL itself; remove env[].address"
            )
        return self


EnvBlock = Annotated[
    Annotated[EnvConfig, Tag(ENV_BLOCK_TAGS[0])] | Annotated[DatasetEnvConfig, Tag(ENV_BLOCK_TAGS[1])],
    Discriminator(env_block_kind),
]
"""One `env:` entry: an environment by id (`- id: ...`) or a dataset with reward functions (`- dataset: ...`)."""
