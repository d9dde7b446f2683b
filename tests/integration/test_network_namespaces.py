"""Inference on one "host", orchestrator and trainer on another: two network namespaces joined by
a veth pair with addresses this test creates (10.200.N.1 and 10.200.N.2). Needs root and iproute2;
skipped otherwise. The run directory is shared (same mount namespace), as on a shared filesystem.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mp_harness import (
    Launcher,
    assert_no_survivors,
    infer_config,
    orch_config,
    train_config,
    trainer_steps,
    wait_for_server,
    write_yaml,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@dataclass
class NetnsPair:
    namespace: str
    """The namespace of the orchestrator and trainer ("host B")."""
    inference_address: str
    """The root namespace's end of the veth pair ("host A")."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    suffix = random.randrange(1, 250)
    namespace, host_end, ns_end = f"grpo-it-{suffix}", f"grpoa{suffix}", f"grpob{suffix}"
    subnet = f"10.200.{suffix}"
    try:
        _ip("netns", "add", namespace)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot create a network namespace here (needs root and iproute2): {error}")
    try:
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", namespace)
        _ip("addr", "add", f"{subnet}.1/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("netns", "exec", namespace, "ip", "addr", "add", f"{subnet}.2/30", "dev", ns_end)
        _ip("netns", "exec", namespace, "ip", "link", "set", ns_end, "up")
        _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        yield NetnsPair(namespace, f"{subnet}.1")
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def test_inference_on_another_host_serves_orchestrator_and_trainer_over_veth(
    netns_pair: NetnsPair, tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server reachable from another host needs a key; every process started here inherits it.
    monkeypatch.setenv("VLLM_API_KEY", "netns-test-key-of-enough-length")
    launcher = Launcher(tmp_path)
    try:
        run_dir = tmp_path / "run"
        port = 18000 + random.randrange(1000)
        address = netns_pair.inference_address
        url = f"http://{address}:{port}/v1"
        infer = infer_config(tiny_model_path, port, lora=True, weight_dir=tmp_path, host=address)
        launcher.start("infer", "grpo-infer", write_yaml(tmp_path / "infer.yaml", infer))
        wait_for_server(url, launcher.processes["infer"], tmp_path / "infer.log")
        in_ns = ("ip", "netns", "exec", netns_pair.namespace)
        orch = write_yaml(tmp_path / "orch.yaml", orch_config(tiny_model_path, run_dir, url, lora=True))
        train = write_yaml(tmp_path / "train.yaml", train_config(tiny_model_path, run_dir, lora=True))
        launcher.start("orch", "grpo-orch", orch, prefix=in_ns)
        launcher.start("train", "grpo-train", train, prefix=in_ns)
        launcher.wait_all(["orch", "train"], 300)
        assert trainer_steps(run_dir) == [0, 1, 2]
        assert launcher.stop("infer") == 0
        assert_no_survivors(launcher.tag)
    finally:
        launcher.kill_everything()
