"""DNS discovery of an elastic pool of inference servers (`client.elastic`).

The pool is whatever the DNS name resolves to now: every A/AAAA record is a server at
http://{ip}:{port}/v1. A background task re-resolves every `sync_interval` seconds and reports
servers that appeared (`on_join`) or disappeared (`on_leave`); the client decides when a joined
server may take requests (after it answers and holds the current policy).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

from grpo.config.orchestrator import ElasticConfig
from grpo.utils.logging import get_logger

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""(hostname, port) -> the IP addresses the name resolves to now (empty: no server)."""

log = get_logger("inference")


async def resolve_dns(hostname: str, port: int) -> list[str]:
    """Every A/AAAA address of `hostname`; an unknown name (no records) is an empty pool."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        # A headless service with no ready members answers NXDOMAIN: that is an empty pool, not a fault.
        log.info("elastic pool %s resolves to no address (%s)", hostname, error)
        return []
    return sorted({str(info[4][0]) for info in infos})


def server_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/v1"


class ElasticPool:
    """Tracks the servers behind `cfg.hostname`; counts joins and leaves."""

    def __init__(
        self,
        cfg: ElasticConfig,
        on_join: Callable[[str], None],
        on_leave: Callable[[str], None],
        resolver: Resolver = resolve_dns,
    ) -> None:
        self.cfg = cfg
        self.urls: set[str] = set()
        """Server URLs the DNS name resolved to at the last sync."""
        self.num_joins = 0
        self.num_leaves = 0
        self._on_join, self._on_leave, self._resolver = on_join, on_leave, resolver
        self._task: asyncio.Task[None] | None = None

    @property
    def description(self) -> str:
        return f"{self.cfg.hostname}:{self.cfg.port}"

    async def sync(self) -> None:
        """Resolve the name once and report the difference to the last sync."""
        addresses = await self._resolver(self.cfg.hostname, self.cfg.port)
        current = {server_url(ip, self.cfg.port) for ip in addresses}
        for url in sorted(self.urls - current):
            self.urls.discard(url)
            self.num_leaves += 1
            log.info("inference server %s left the pool %s", url, self.description)
            self._on_leave(url)
        for url in sorted(current - self.urls):
            self.urls.add(url)
            self.num_joins += 1
            log.info("inference server %s joined the pool %s", url, self.description)
            self._on_join(url)

    def start(self) -> None:
        """Start re-resolving in the background (first sync at once); idempotent."""
        if self._task is None:
            self._task = asyncio.create_task(self._sync_forever())

    def raise_if_failed(self) -> None:
        """Surface an error that stopped the background sync (e.g. a failing custom resolver)."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            error = self._task.exception()
            if error is not None:
                raise error

    async def _sync_forever(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.cfg.sync_interval)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
