"""Peak resident memory of a command's process tree, read from the kernel while it runs.

Each process's VmHWM (/proc/PID/status) is the most resident memory it held since it started,
kept by the kernel, so sampling it now and then loses no spike; only what a process reaches after
the last sample before it exits goes unseen. A process is named by its last command line seen
(vLLM renames its engine processes to VLLM::EngineCore and VLLM::Worker after they start).
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SAMPLE_INTERVAL_S = 0.2


@dataclass
class ProcessPeak:
    name: str
    peak_bytes: int


@dataclass
class TreePeaks:
    root_pid: int
    by_pid: dict[int, ProcessPeak] = field(default_factory=dict)

    def root(self) -> int:
        return self.by_pid[self.root_pid].peak_bytes

    def named(self, prefix: str) -> int:
        """Summed peaks of the processes whose name starts with `prefix` (a bound on what they
        held at once)."""
        return sum(p.peak_bytes for p in self.by_pid.values() if p.name.startswith(prefix))

    def describe(self) -> str:
        rows = sorted(self.by_pid.items(), key=lambda item: -item[1].peak_bytes)
        return ", ".join(f"{pid} {p.name[:40]!r} {p.peak_bytes / 2**30:.2f} GiB" for pid, p in rows[:8])


def _high_water_mark(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _sample(peaks: TreePeaks) -> None:
    try:
        root = psutil.Process(peaks.root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        hwm = _high_water_mark(process.pid)
        if hwm is None:
            continue
        try:
            name = " ".join(process.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        known = peaks.by_pid.get(process.pid)
        peak = max(hwm, known.peak_bytes if known is not None else 0)
        peaks.by_pid[process.pid] = ProcessPeak(name or (known.name if known else ""), peak)


def run_with_peaks(
    args: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], TreePeaks, float]:
    """Run `args` to the end (killed past `timeout_s`), sampling its process tree's peaks; returns
    the finished process (stdout and stderr together), the peaks and the wall time in seconds."""
    started = time.monotonic()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peaks = TreePeaks(process.pid)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            _sample(peaks)
            done.wait(SAMPLE_INTERVAL_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    finally:
        done.set()
        sampler.join()
    wall_s = time.monotonic() - started
    return subprocess.CompletedProcess(args, process.returncode, output, None), peaks, wall_s
