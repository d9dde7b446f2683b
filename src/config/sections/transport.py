"""How batches reach the trainer (`rollout_transport` in orch.yaml, `transport_type`/`zmq_*` in
train.yaml) and new weights reach inference (`weight_broadcast`, in orch.yaml and train.yaml):
grpo.config.across_files.shared_facts keeps the files' keys in agreement."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from grpo.config.base import StrictModel


class FilesystemRolloutTransport(StrictModel):
    type: Literal["filesystem"] = "filesystem"


class ZmqRolloutTransport(StrictModel):
    type: Literal["zmq"]
    host: str = "localhost"
    """ZMQ host (the trainer binds, the orchestrator connects)."""

    port: int = Field(5555, ge=1, le=65535)
    """ZMQ port."""

    hwm: int = Field(10, ge=1)
    """High-water mark: batches queued before the sender blocks (back-pressure)."""

    secret_env: str = "GRPO_ZMQ_SECRET"
    """Environment variable holding the secret of the batch link: it keys the link's CURVE
    encryption (a peer without it cannot connect) and the HMAC-SHA256 tag on every message; the
    trainer's zmq_secret_env must hold the same value. Unset = neither (loopback only)."""

    @model_validator(mode="after")
    def _secret_off_loopback(self) -> ZmqRolloutTransport:
        from grpo.utils.auth import open_without_secret

        if open_without_secret(self.host, self.secret_env):
            raise ValueError(
                f"batches to {self.host} cross the network, so they must be signed: export "
                f"{self.secret_env}=<the secret grpo-train uses> for grpo-orch, or use host: 127.0.0.1"
            )
        return self


RolloutTransportConfig = Annotated[
    FilesystemRolloutTransport | ZmqRolloutTransport, Field(discriminator="type")
]


class FilesystemWeightBroadcast(StrictModel):
    type: Literal["filesystem"] = "filesystem"


class NcclWeightBroadcast(StrictModel):
    type: Literal["nccl"]
    host: str = "localhost"
    """Rendezvous host."""

    port: int = Field(29501, ge=1, le=65535)
    """Rendezvous port."""

    timeout: float = Field(1200, gt=0)
    """Seconds before a missing peer is reported."""

    num_servers: int = Field(1, ge=1)
    """Inference servers receiving the weights: the collective's world size is 1 + num_servers (the
    trainer waits for exactly these). Must equal the number of servers in the orchestrator's
    client.base_url; set the same value in train.yaml and orch.yaml."""

    bucket_mib: int = Field(512, ge=1)
    """Most MiB of weights sent (and allocated by each server) at once: each policy crosses in
    buckets of consecutive tensors no larger than this (a larger tensor alone), floating tensors in
    the servers' own dtype."""

    secret_env: str = "GRPO_WEIGHTS_SECRET"
    """Environment variable holding the secret the trainer and the inference servers prove to each
    other (HMAC-SHA256 challenge-response) and sign each update's manifest with; every grpo-infer
    needs the same value (in the variable its weight_secret_env names). Required when host is not
    a loopback address; unset on loopback = unauthenticated."""

    @model_validator(mode="after")
    def _secret_off_loopback(self) -> NcclWeightBroadcast:
        from grpo.utils.auth import open_without_secret

        if open_without_secret(self.host, self.secret_env):
            raise ValueError(
                f"weight_broadcast host {self.host} is reachable from other machines, so the trainer and the "
                f"inference servers must prove a shared secret: export {self.secret_env}=<a long random string> "
                "for grpo-train, grpo-orch and every grpo-infer, or use host: 127.0.0.1"
            )
        return self


WeightBroadcastConfig = Annotated[
    FilesystemWeightBroadcast | NcclWeightBroadcast, Field(discriminator="type")
]
