"""The client's side of a dead or hung inference server (orch.yaml `client.recovery`).

A server is taken out of routing when its /health fails (no answer within `health_timeout_s`, a
refused connection, a 5xx) or a request to it loses its connection. Its requests in flight are
aborted and retried on another server, or on it once it is back: a group's request either returns
whole or is sent again whole, so no rollout group is lost or counted twice. A background task
waits for the server to answer again, loads the current policy into it (the client's replay, as
for a server joining an elastic pool), and only then routes to it again. A server that does not
serve again within `deadline_s` fails the run with one line naming it: every request from then on
raises that error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

from grpo.config.sections.supervisor import ServerRecoveryConfig
from grpo.utils.logging import get_logger

T = TypeVar("T")

NO_SERVER_POLL_S = 0.05

log = get_logger("inference")


class ServerDownError(RuntimeError):
    """A request was aborted because its server was taken out of routing."""


class ServerLostError(TimeoutError):
    """A server taken out of routing did not serve again within client.recovery.deadline_s."""


def health_url(base_url: str) -> str:
    """vLLM's /health sits beside /v1, not under it."""
    return base_url.removesuffix("/v1") + "/health"


class ServerRecovery:
    """Watches the servers in `routing` (the client's list of servers taking requests, changed in
    place) and brings back the ones that fail. `bring_to_policy(url)` returns once `url` answers and
    holds the current policy; `forget_sessions(url)` drops the multi-turn sessions pinned to it."""

    def __init__(
        self,
        cfg: ServerRecoveryConfig,
        http: httpx.AsyncClient,
        routing: list[str],
        bring_to_policy: Callable[[str], Awaitable[None]],
        forget_sessions: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self._http = http
        self._routing = routing
        self._order = list(routing)
        """Every server in its configured order (a collective's ranks follow it)."""
        self._bring_to_policy = bring_to_policy
        self._forget_sessions = forget_sessions
        self._lost: dict[str, asyncio.Event] = {}
        self._recoveries: dict[str, asyncio.Task[None]] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._error: ServerLostError | None = None
        self.num_recoveries = 0
        """Servers taken out and brought back so far (a restart the orchestrator saw)."""

    def metrics(self) -> dict[str, int]:
        return {"pool/num_recoveries": self.num_recoveries, "pool/num_recovering": len(self._recoveries)}

    def start(self) -> None:
        """Start the health checks (idempotent)."""
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._check_forever())

    def is_recovering(self, url: str) -> bool:
        return url in self._recoveries

    def raise_if_lost(self) -> None:
        if self._error is not None:
            raise self._error

    def take_out(self, url: str, reason: str) -> None:
        """Stop routing to `url`, abort its requests in flight, and start bringing it back."""
        if url not in self._routing:
            return
        self._routing.remove(url)
        self._lost.pop(url, asyncio.Event()).set()
        self._forget_sessions(url)
        log.warning(
            "inference server %s taken out of routing (%s); its requests go elsewhere, and it takes "
            "requests again once it answers and holds the current policy (within %g s)",
            url,
            reason,
            self.cfg.deadline_s,
        )
        self._recoveries[url] = asyncio.create_task(self._recover(url, reason))

    async def until_lost(self, url: str, request: Awaitable[T]) -> T:
        """`request`, aborted with ServerDownError when `url` is taken out before it answers."""
        lost = self._lost.setdefault(url, asyncio.Event())
        answer = asyncio.ensure_future(request)
        gone = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            if answer.done():
                return answer.result()
            raise ServerDownError(f"{url} was taken out of routing while the request ran")
        finally:
            for task in (answer, gone):
                task.cancel()
            await asyncio.gather(answer, gone, return_exceptions=True)

    async def wait_for_any_server(self) -> None:
        """Until some server takes requests; raises ServerLostError once one is given up on."""
        while not self._routing:
            self.raise_if_lost()
            await asyncio.sleep(NO_SERVER_POLL_S)
        self.raise_if_lost()

    async def _recover(self, url: str, reason: str) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await asyncio.wait_for(self._bring_to_policy(url), self.cfg.deadline_s)
        except ServerLostError as error:
            self._error = error
            log.error("%s", error)
            return
        except TimeoutError:
            self._error = ServerLostError(
                f"inference server {url} stopped serving ({reason}) and did not serve again within "
                f"client.recovery.deadline_s {self.cfg.deadline_s:g} s; restart it (grpo-infer "
                "supervisor.enabled restarts it by itself) and resume the run with ckpt.resume_step -1"
            )
            log.error("%s", self._error)
            return
        finally:
            del self._recoveries[url]
        taking = set(self._routing) | {url}
        self._routing[:] = [u for u in self._order if u in taking]
        self.num_recoveries += 1
        log.info(
            "inference server %s takes requests again with the current policy, %.1f s after it was "
            "taken out (%d recovery(ies) so far)",
            url,
            loop.time() - started,
            self.num_recoveries,
        )

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            urls = list(self._routing)
            problems = await asyncio.gather(*(self._health_problem(url) for url in urls))
            for url, problem in zip(urls, problems, strict=True):
                if problem is not None:
                    self.take_out(url, problem)

    async def _health_problem(self, url: str) -> str | None:
        try:
            # asyncio's deadline too: httpx's timeouts bound each network operation, not the request.
            response = await asyncio.wait_for(
                self._http.get(health_url(url), timeout=self.cfg.health_timeout_s), self.cfg.health_timeout_s
            )
        except (httpx.TimeoutException, TimeoutError):
            return (
                f"/health unanswered for {self.cfg.health_timeout_s:g} s (client.recovery.health_timeout_s)"
            )
        except httpx.TransportError as error:
            return f"/health: {type(error).__name__} {error}"
        if response.status_code >= 500:
            return f"/health answered HTTP {response.status_code}"
        return None

    async def close(self) -> None:
        tasks = [*self._recoveries.values(), *([self._monitor] if self._monitor else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._monitor = None
