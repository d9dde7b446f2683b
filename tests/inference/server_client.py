"""Drive a test's ServerThread through a fresh InferenceClient (no retries: a failure shows at once)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from grpo.config.orchestrator import ClientConfig
from grpo.inference.client import InferenceClient
from grpo.inference.server import ServerThread

T = TypeVar("T")


def with_client(server: ServerThread, action: Callable[[InferenceClient], Awaitable[T]]) -> T:
    async def main() -> T:
        client = InferenceClient(ClientConfig(base_url=[server.base_url], max_retries=0, timeout=120))
        try:
            return await action(client)
        finally:
            await client.close()

    return asyncio.run(main())
