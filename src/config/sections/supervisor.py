"""Recovery from a dead or hung inference server: infer.yaml `supervisor` (the server side: restart
it) and orch.yaml `client.recovery` (the orchestrator side: route around it, bring it back to the
current policy, give up after a deadline)."""

from __future__ import annotations

from pydantic import Field, model_validator

from grpo.config.base import StrictModel


class SupervisorConfig(StrictModel):
    """`grpo-infer` as a supervisor of the vLLM server it runs (infer.yaml `supervisor`)."""

    enabled: bool = False
    """Run the vLLM server as a child process and restart it when it dies (engine crash, OOM kill) or
    hangs (no /health answer within health_timeout_s; it is SIGKILLed with every process under it
    first). Off by default, like `vllm serve`: the process is the server and exits with its engine,
    for a cluster manager (systemd, Kubernetes) to restart. The orchestrator brings a restarted
    server to the current policy before routing to it either way (orch.yaml client.recovery)."""

    health_interval_s: float = Field(5.0, gt=0)
    """Seconds between /health checks of the running server."""

    health_timeout_s: float = Field(30.0, gt=0)
    """A server whose /health has not answered 200 for this long is hung: killed and restarted."""

    startup_timeout_s: float = Field(600.0, gt=0)
    """A (re)started server that does not answer /health within this many seconds is restarted."""

    max_restarts: int = Field(5, ge=0)
    """Restarts allowed over the supervisor's life; after that it exits 1 (the orchestrator then
    fails the run after client.recovery.deadline_s)."""


class ServerRecoveryConfig(StrictModel):
    """How the orchestrator's client handles a server that stops answering (orch.yaml
    `client.recovery`; a fixed client.base_url list: an elastic pool's servers leave by DNS)."""

    enabled: bool = True
    """Health-check the servers; take a dead or hung one out of routing (its in-flight requests
    are retried on another server, or on it once it is back), and when it answers again load the
    current policy into it before it takes requests. Off: a failing request is retried
    client.max_retries times on the same server, then fails the run."""

    health_interval_s: float = Field(5.0, gt=0)
    """Seconds between /health checks of each server that takes requests."""

    health_timeout_s: float = Field(30.0, gt=0)
    """A server whose /health does not answer within this many seconds is taken out of routing (a
    refused connection or a 5xx answer takes it out at once)."""

    deadline_s: float = Field(900.0, gt=0)
    """A server out of routing that does not serve again (with the current policy) within this many
    seconds fails the run, naming it. Leave room for a restart: vLLM start-up and the policy load."""

    @model_validator(mode="after")
    def _deadline_after_health_timeout(self) -> ServerRecoveryConfig:
        if self.enabled and self.deadline_s <= self.health_interval_s:
            raise ValueError(
                f"client.recovery.deadline_s {self.deadline_s} is not longer than health_interval_s "
                f"{self.health_interval_s}: a server could never be seen back in time; raise deadline_s"
            )
        return self
