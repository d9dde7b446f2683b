"""Full weights over the collective (weight_broadcast type nccl): every server receives the trainer's
broadcast at once, each through its receive route (grpo.inference.weight_routes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from grpo.config.sections.transport import NcclWeightBroadcast
from grpo.inference.weight_routes import RECEIVE_WEIGHTS_ROUTE

RECEIVE_WEIGHTS_PATH = RECEIVE_WEIGHTS_ROUTE.removeprefix("/v1")
"""Below a server's base URL (which ends in /v1)."""

Post = Callable[..., Awaitable[Any]]
"""InferenceClient._post: (url, path, body, timeout) with its retries."""


async def receive_over_collective(
    post: Post, base_urls: list[str], wb: NcclWeightBroadcast, manifest: dict[str, Any]
) -> None:
    """Have every server in `base_urls` receive the policy `manifest` announces; fails as soon as one
    server fails."""
    # The trainer is rank 0; the i-th server is rank i. The trainer refuses a server told another
    # world size than its weight_broadcast.num_servers gives (orch.yaml's is checked at load).
    world_size = len(base_urls) + 1
    common = {"host": wb.host, "port": wb.port, "timeout": wb.timeout, "version": manifest["version"]}

    async def receive(rank: int, url: str) -> None:
        body = {**common, "rank": rank, "world_size": world_size}
        try:
            # The route answers once the weights are in: the collective's own timeout plus slack.
            await post(url, RECEIVE_WEIGHTS_PATH, body, timeout=wb.timeout + 60.0)
        except RuntimeError as error:  # TransientServerError included
            raise RuntimeError(
                f"inference server {url} (rank {rank} of {world_size}) did not receive policy "
                f"{manifest['version']} over the collective: {error}"
            ) from error

    # Fail as soon as one server fails (a server that is down fails at once): the trainer and the
    # other servers then time out naming its rank instead of waiting for it.
    receives = [asyncio.create_task(receive(rank, url)) for rank, url in enumerate(base_urls, 1)]
    try:
        for finished in asyncio.as_completed(receives):
            await finished
    finally:
        for task in receives:
            task.cancel()
        await asyncio.gather(*receives, return_exceptions=True)
