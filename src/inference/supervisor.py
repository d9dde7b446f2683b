"""`grpo-infer` with `supervisor.enabled`: the vLLM server runs as a child process that is
restarted when it dies or hangs.

The supervisor checks the child's /health every `health_interval_s`. A child that exits, or whose
/health has not answered 200 for `health_timeout_s` (a SIGSTOPped or deadlocked server), is
SIGKILLed together with every process it started (vLLM's engine core and workers: they are tracked
while the child runs, and this process is made their subreaper, so none outlives it), and a new
child is started on the same port. At most `max_restarts` times; then the supervisor exits 1.

The restarted server comes up with the base model. The orchestrator's client, which knows the
current policy (it loaded every one), notices the server went away, waits until it answers again,
loads the current policy into it, and only then routes requests to it (grpo.inference.client,
orch.yaml client.recovery): so the policy is never one the run did not reach, and a server
restarted by anything else (systemd, Kubernetes) is treated the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from grpo.utils.logging import get_logger
from grpo.utils.ports import HELD_PORT_ENV, reserve_port

if TYPE_CHECKING:
    from grpo.config.inference import InferenceConfig
    from grpo.config.sections.supervisor import SupervisorConfig

log = get_logger("supervisor")

STARTUP_POLL_S = 0.25
"""Seconds between /health probes of a child that is starting (recovery time counts them)."""
STOP_GRACE_S = 30.0
"""On SIGTERM, how long the child may take to stop its engine before everything is SIGKILLed."""
LEFTOVER_GRACE_S = 5.0
"""After the child stopped, how long the processes it started may take to end by themselves."""
RESTART_ENV = "GRPO_SERVER_RESTART"
"""Set in the child's environment: how many restarts came before it (0 for the first)."""
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class Supervisor:
    """Runs `argv` as a child, restarting it when it exits or stops answering `health_url`."""

    def __init__(
        self,
        cfg: SupervisorConfig,
        argv: list[str],
        health_url: str,
        stop: threading.Event | None = None,
        env: dict[str, str] | None = None,
        reap: Callable[[], object] = lambda: None,
    ) -> None:
        """`reap`: ends what a dead child left that was never seen as its descendant (a process it
        started just before it died), called after each kill; `supervise` ends the orphans that
        were re-parented to this process."""
        self.cfg = cfg
        self.argv = argv
        self.health_url = health_url
        self.stop = stop or threading.Event()
        """Set it (SIGTERM/SIGINT do in `supervise`) to stop the child and return 0."""
        self.env = dict(os.environ if env is None else env)
        self.num_restarts = 0
        self.num_serving = 0
        """Children that answered /health (the first, then one per successful restart)."""
        self._reap = reap
        self.recovery_seconds: list[float] = []
        """Per restart: seconds from noticing the failure to the new child answering /health."""
        self._descendants: dict[int, psutil.Process] = {}

    def run(self) -> int:
        """Supervise until `stop` is set (0) or the child failed past max_restarts (1). Blocking."""
        failed_at: float | None = None
        while True:
            child = self._spawn()
            reason = self._watch(child, failed_at)
            if reason is None:  # stop was set
                self._end_gracefully(child)
                log.info("supervisor stopped the inference server after %d restart(s)", self.num_restarts)
                return 0
            failed_at = time.monotonic()
            self._kill_all(child)
            if self.stop.is_set():  # it exited because the same Ctrl-C reached it first
                return 0
            if self.num_restarts >= self.cfg.max_restarts:
                log.error(
                    "inference server %s; supervisor.max_restarts %d reached, giving up (exit 1)",
                    reason,
                    self.cfg.max_restarts,
                )
                return 1
            self.num_restarts += 1
            log.warning(
                "inference server %s; restart %d of at most %d",
                reason,
                self.num_restarts,
                self.cfg.max_restarts,
            )

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = {**self.env, RESTART_ENV: str(self.num_restarts)}
        child = subprocess.Popen(self.argv, env=env, preexec_fn=_die_with_parent)
        self._descendants = {}
        log.info("started inference server process %d (restart %d)", child.pid, self.num_restarts)
        return child

    def _watch(self, child: subprocess.Popen[bytes], failed_at: float | None) -> str | None:
        """Why the child must be replaced, or None once `stop` is set."""
        started = last_ok = time.monotonic()
        serving = False
        while not self.stop.is_set():
            code = child.poll()
            if code is not None:
                return f"process {child.pid} exited with code {code}"
            healthy = self._healthy()
            self._track(child)  # after the probe: a server that answers has started its engine
            now = time.monotonic()
            if healthy:
                last_ok = now
                if not serving:
                    serving = True
                    self.num_serving += 1
                    if failed_at is not None:
                        self.recovery_seconds.append(now - failed_at)
                        log.info(
                            "inference server answers /health again, %.1f s after the failure (restart %d)",
                            now - failed_at,
                            self.num_restarts,
                        )
            elif not serving and now - started > self.cfg.startup_timeout_s:
                return f"did not answer /health within supervisor.startup_timeout_s {self.cfg.startup_timeout_s:g} s"
            elif serving and now - last_ok > self.cfg.health_timeout_s:
                return (
                    f"(process {child.pid}) hung: /health unanswered for "
                    f"{now - last_ok:.0f} s (supervisor.health_timeout_s {self.cfg.health_timeout_s:g})"
                )
            self.stop.wait(self.cfg.health_interval_s if serving else STARTUP_POLL_S)
        return None

    def _healthy(self) -> bool:
        import httpx

        timeout = min(self.cfg.health_timeout_s, max(self.cfg.health_interval_s, 1.0))
        try:
            return httpx.get(self.health_url, timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def _track(self, child: subprocess.Popen[bytes]) -> None:
        """Remember the child's descendants now: once it is dead they are no longer its children."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in psutil.Process(child.pid).children(recursive=True):
                self._descendants.setdefault(process.pid, process)

    def _tree(self, child: subprocess.Popen[bytes]) -> list[psutil.Process]:
        self._track(child)
        processes = list(self._descendants.values())
        with contextlib.suppress(psutil.NoSuchProcess):
            processes.append(psutil.Process(child.pid))
        return [p for p in processes if p.is_running()]

    def _kill_all(self, child: subprocess.Popen[bytes]) -> None:
        """SIGKILL the child and everything it started (a stopped process dies of SIGKILL too)."""
        tree = self._tree(child)
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(tree, timeout=STOP_GRACE_S)
        child.wait()
        self._reap()
        if tree:
            log.info("killed %d inference process(es): %s", len(tree), ", ".join(str(p.pid) for p in tree))

    def _end_gracefully(self, child: subprocess.Popen[bytes]) -> None:
        tree = self._tree(child)
        if child.poll() is None:
            child.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(STOP_GRACE_S)
        # Helpers that end on their own once the server is gone (multiprocessing's resource
        # tracker cleans up shared memory then) get a moment before anything is killed.
        _gone, alive = psutil.wait_procs(tree, timeout=LEFTOVER_GRACE_S)
        if alive:
            self._kill_all(child)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the supervisor dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def supervise(cfg: InferenceConfig) -> int:
    """`grpo-infer` with supervisor.enabled: serve `cfg` from a supervised child until SIGTERM/SIGINT
    (returns 0) or until it failed more than max_restarts times (returns 1). Blocking."""
    from grpo.inference.server import _children, end_processes

    if sys.platform.startswith("linux"):
        # An engine process whose server was killed is re-parented here, where it is ended.
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # Port 0 picks one port for the supervisor's whole life: clients find every restart on it. It
    # stays held here, so nothing else takes it while a server starts or between restarts.
    held = None if cfg.port else reserve_port(cfg.bind_host, for_reuse_port=True)
    port = int(held.getsockname()[1]) if held is not None else cfg.port
    if held is not None:
        os.environ[HELD_PORT_ENV] = str(port)  # the server binds with SO_REUSEPORT, past the hold
    child_cfg = cfg.model_copy(
        update={"port": port, "supervisor": cfg.supervisor.model_copy(update={"enabled": False})}
    )
    probe_host = "127.0.0.1" if cfg.bind_host in ("0.0.0.0", "::") else cfg.bind_host
    probe_host = f"[{probe_host}]" if ":" in probe_host else probe_host
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    with tempfile.TemporaryDirectory(prefix="grpo-infer-") as folder:
        config_path = Path(folder) / "infer.json"
        config_path.write_text(child_cfg.model_dump_json())
        supervisor = Supervisor(
            cfg.supervisor,
            [sys.executable, "-m", "grpo.inference.supervisor", str(config_path)],
            f"http://{probe_host}:{port}/health",
            stop,
            reap=lambda: end_processes(_children()),
        )
        log.info(
            "supervising the inference server on port %d (health every %g s, hung after %g s, "
            "at most %d restarts)",
            port,
            cfg.supervisor.health_interval_s,
            cfg.supervisor.health_timeout_s,
            cfg.supervisor.max_restarts,
        )
        try:
            return supervisor.run()
        finally:
            end_processes(_children())
            if held is not None:
                held.close()


def _child_main(config_path: str) -> int:
    """The supervised child: one plain server for the config the supervisor wrote."""
    from grpo.config.inference import InferenceConfig
    from grpo.inference.server import run_server

    cfg = InferenceConfig.model_validate_json(Path(config_path).read_text())
    return run_server(cfg)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
