"""orch.yaml `client` (and `teacher_model.client`): how the orchestrator reaches its inference
servers, a fixed list or a DNS-discovered elastic pool, and routes around one that fails."""

from __future__ import annotations

from pydantic import Field, model_validator

from grpo.config.base import StrictModel
from grpo.config.sections.supervisor import ServerRecoveryConfig


class ElasticConfig(StrictModel):
    hostname: str
    """DNS name whose A records are the inference servers of an elastic pool."""

    port: int = Field(8000, ge=1, le=65535)
    """Port of every server in the pool."""

    sync_interval: float = Field(5.0, gt=0)
    """Seconds between DNS re-resolutions."""


class ClientConfig(StrictModel):
    base_url: list[str] = Field(default_factory=lambda: ["http://localhost:8000/v1"])
    """Inference server URL(s); requests go to the least-loaded one."""

    timeout: float = Field(1200, gt=0)
    """Request timeout in seconds."""

    api_key_var: str | None = "VLLM_API_KEY"
    """Env var holding the API key sent to the servers (null: none is sent)."""

    skip_model_check: bool = False
    """Skip checking that the servers' /models lists the model."""

    max_retries: int = Field(3, ge=0)
    """Retries on transient errors (connection errors, 5xx, 429); other errors fail at once."""

    elastic: ElasticConfig | None = None
    """Discover servers by DNS instead of a fixed base_url list."""

    recovery: ServerRecoveryConfig = Field(default_factory=ServerRecoveryConfig)
    """Route around a dead or hung server and bring it back to the current policy."""

    # Whether base_url is set beside elastic is the client's check (grpo.inference.client): a resolved
    # copy of this config (configs/orch.yaml, which grpo-train validates) holds the default base_url.
    @model_validator(mode="after")
    def _some_server(self) -> ClientConfig:
        if self.elastic is None and not self.base_url:
            raise ValueError(
                "client.base_url is empty; list at least one server, e.g. http://localhost:8000/v1"
            )
        return self


class TeacherClientConfig(ClientConfig):
    api_key_var: str | None = None
    """Env var holding the API key sent to the teacher server; null sends none. The teacher runs
    elsewhere, so the run's own inference key ($VLLM_API_KEY, which may load adapters into the
    run's servers) is never sent to it unless named here."""
