from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.transport.weights_collective import CollectiveWeightReceiver, CollectiveWeightSender


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_receiver_process(port: int, out_dir: Path, num_updates: int) -> subprocess.Popen:
    """An inference-worker stand-in that saves every update it receives as safetensors."""
    script = textwrap.dedent(
        f"""
        from safetensors.torch import save_file
        from grpo.transport.weights_collective import CollectiveWeightReceiver
        receiver = CollectiveWeightReceiver("localhost", {port}, timeout=60, backend="gloo")
        for _ in range({num_updates}):
            step, named = receiver.receive()
            save_file(dict(named), {str(out_dir)!r} + f"/update_{{step}}.safetensors")
        receiver.close()
        """
    )
    return subprocess.Popen([sys.executable, "-c", script])


def _weights(step: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(step)
    return [
        ("model.embed_tokens.weight", torch.randn(32, 8, generator=generator)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=generator).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(8, generator=generator).to(torch.float16)),
        ("step_counter", torch.tensor([step, -step], dtype=torch.int64)),
        ("transposed_view", torch.randn(4, 6, generator=generator).t()),  # non-contiguous on purpose
    ]


def test_full_weights_arrive_exact_in_another_process_over_gloo(tmp_path: Path) -> None:
    port = _free_port()
    receiver_process = _start_receiver_process(port, tmp_path, num_updates=2)
    sender = CollectiveWeightSender("localhost", port, timeout=60, backend="gloo")
    try:
        for step in (1, 2):
            sender.send(step, _weights(step))
        assert receiver_process.wait(timeout=60) == 0
    finally:
        sender.close()
        receiver_process.kill()
        receiver_process.wait()
    for step in (1, 2):
        received = load_file(tmp_path / f"update_{step}.safetensors")
        expected = dict(_weights(step))
        assert set(received) == set(expected)
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype, name
            assert torch.equal(received[name], tensor), name


def test_sender_without_receiver_times_out_naming_address_and_peer() -> None:
    port = _free_port()
    sender = CollectiveWeightSender("localhost", port, timeout=0.5, backend="gloo")
    with pytest.raises(TimeoutError, match=rf"localhost:{port}.*no receiver \(inference server\) joined"):
        sender.send(1, _weights(1))
    sender.close()


def test_receiver_without_sender_times_out_naming_address_and_peer() -> None:
    port = _free_port()
    receiver = CollectiveWeightReceiver("localhost", port, timeout=0.5, backend="gloo")
    with pytest.raises(TimeoutError, match=rf"localhost:{port}.*sender \(trainer\)"):
        receiver.receive()
