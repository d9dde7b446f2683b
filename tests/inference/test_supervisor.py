"""The grpo-infer supervisor restarting a fake server (a tiny HTTP process with a child of its own,
standing in for vLLM's API server and its engine process) that dies or hangs."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from free_ports import free_port

from grpo.config.sections.supervisor import SupervisorConfig
from grpo.inference.supervisor import RESTART_ENV, Supervisor

FAKE_SERVER = """
import http.server, os, signal, subprocess, sys

port, folder = int(sys.argv[1]), sys.argv[2]
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(folder, f"{os.getpid()}.tmp"), "w") as f:
    f.write(f"{engine.pid} {os.environ['RESTART_ENV']}")
os.rename(os.path.join(folder, f"{os.getpid()}.tmp"), os.path.join(folder, str(os.getpid())))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

def stop(*_):
    engine.terminate()
    engine.wait()
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
http.server.ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()
""".replace("RESTART_ENV", RESTART_ENV)


@dataclass
class Supervised:
    supervisor: Supervisor
    thread: threading.Thread
    folder: Path
    result: list[int]

    def servers(self) -> list[tuple[int, int, int]]:
        """(server pid, its engine's pid, restart number) of each server started so far, in order."""
        found = []
        for path in self.folder.iterdir():
            if path.name.isdigit():
                engine, restart = path.read_text().split()
                found.append((int(path.name), int(engine), int(restart)))
        return sorted(found, key=lambda server: server[2])

    def wait_for_servers(self, count: int, timeout: float = 30.0) -> list[tuple[int, int, int]]:
        deadline = time.monotonic() + timeout
        while len(self.servers()) < count:
            assert time.monotonic() < deadline, f"{count} server(s) not started in {timeout} s"
            time.sleep(0.05)
        return self.servers()

    def wait_serving(self, restarts: int, timeout: float = 30.0) -> None:
        """Until the server of restart `restarts` answers /health."""
        deadline = time.monotonic() + timeout
        while self.supervisor.num_serving < restarts + 1:
            assert time.monotonic() < deadline, f"not serving after restart {restarts} in {timeout} s"
            time.sleep(0.05)


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Callable[..., Supervised]]:
    started: list[Supervised] = []

    def start(**cfg: object) -> Supervised:
        script = tmp_path / "fake_server.py"
        script.write_text(FAKE_SERVER)
        port = free_port()
        config = SupervisorConfig.model_validate(
            {"health_interval_s": 0.1, "health_timeout_s": 1.0, "startup_timeout_s": 20.0, **cfg}
        )
        supervisor = Supervisor(
            config, [sys.executable, str(script), str(port), str(tmp_path)], f"http://127.0.0.1:{port}/health"
        )
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(supervisor.run()), daemon=True)
        thread.start()
        supervised = Supervised(supervisor, thread, tmp_path, result)
        started.append(supervised)
        return supervised

    yield start
    for supervised in started:
        supervised.supervisor.stop.set()
        supervised.thread.join(60)
        for server, engine, _restart in supervised.servers():
            assert gone(server) and gone(engine), "a fake server or its engine outlived the test"


def test_a_killed_server_is_restarted_and_its_engine_process_does_not_outlive_it(
    supervise: Callable[..., Supervised],
) -> None:
    supervised = supervise()
    ((server, engine, restart),) = supervised.wait_for_servers(1)
    assert restart == 0
    supervised.wait_serving(0)
    os.kill(server, signal.SIGKILL)
    _, (new_server, new_engine, new_restart) = supervised.wait_for_servers(2)
    assert gone(engine), "the dead server's engine process was orphaned"
    assert new_restart == 1 and new_server != server and new_engine != engine
    supervised.wait_serving(1)
    assert supervised.supervisor.num_restarts == 1
    assert len(supervised.supervisor.recovery_seconds) == 1


def test_a_frozen_server_is_killed_with_its_engine_after_the_health_timeout_and_restarted(
    supervise: Callable[..., Supervised],
) -> None:
    supervised = supervise()
    ((server, engine, _),) = supervised.wait_for_servers(1)
    supervised.wait_serving(0)
    os.kill(server, signal.SIGSTOP)
    frozen_at = time.monotonic()
    supervised.wait_for_servers(2)
    assert time.monotonic() - frozen_at >= 1.0  # health_timeout_s
    assert gone(server) and gone(engine)
    supervised.wait_serving(1)
    assert supervised.supervisor.num_restarts == 1


def test_past_max_restarts_the_supervisor_gives_up_with_exit_code_1_leaving_no_process(
    supervise: Callable[..., Supervised],
) -> None:
    supervised = supervise(max_restarts=1)
    for count in (1, 2):
        server, _engine, _ = supervised.wait_for_servers(count)[-1]
        supervised.wait_serving(count - 1)
        os.kill(server, signal.SIGKILL)
    supervised.thread.join(30)
    assert supervised.result == [1]
    for server, engine, _ in supervised.servers():
        assert gone(server) and gone(engine)


def test_stop_ends_the_server_gracefully_and_returns_0(supervise: Callable[..., Supervised]) -> None:
    supervised = supervise()
    ((server, engine, _),) = supervised.wait_for_servers(1)
    supervised.supervisor.stop.set()
    supervised.thread.join(30)
    assert supervised.result == [0]
    assert gone(server) and gone(engine)
    assert supervised.supervisor.num_restarts == 0
