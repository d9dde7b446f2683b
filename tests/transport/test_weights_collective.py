"""Full weights trainer -> inference workers over gloo: one sender, one or several receivers."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

import grpo.inference.client as client_module
from grpo.config.orchestrator import ClientConfig, NcclWeightBroadcast
from grpo.inference import vllm_compat, weight_routes
from grpo.inference.client import InferenceClient
from grpo.inference.worker_extension import WorkerExtension
from grpo.transport.weights_announce import write_collective_manifest
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


class _Outcome:
    """What a thread running one rank ended with: its return value or its exception."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None


def _in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, _Outcome]:
    outcome = _Outcome()

    def run() -> None:
        try:
            outcome.value = work()
        except BaseException as error:  # handed to the test thread, which asserts on it
            outcome.error = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _receive_updates(port: int, rank: int, world_size: int, num_updates: int, timeout: float = 60) -> Any:
    receiver = CollectiveWeightReceiver(
        "localhost", port, timeout=timeout, backend="gloo", rank=rank, world_size=world_size
    )
    try:
        return [receiver.receive() for _ in range(num_updates)]
    finally:
        receiver.close()


def test_three_receivers_get_identical_weights_for_two_versions() -> None:
    port = _free_port()
    receivers = [_in_thread(lambda r=rank: _receive_updates(port, r, 4, num_updates=2)) for rank in (1, 2, 3)]
    sender = CollectiveWeightSender("localhost", port, timeout=60, backend="gloo")
    try:
        for step in (1, 2):
            sender.send(step, _weights(step))
    finally:
        sender.close()
    assert sender.world_size == 4
    for thread, outcome in receivers:
        thread.join(timeout=60)
        assert outcome.error is None, outcome.error
        assert [step for step, _ in outcome.value] == [1, 2]
        for step, named in outcome.value:
            expected = _weights(step)
            assert [name for name, _ in named] == [name for name, _ in expected]
            for (name, got), (_, want) in zip(named, expected, strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want), name


def test_a_missing_receiver_is_named_by_the_sender_and_the_other_receivers() -> None:
    port = _free_port()
    # Ranks 1 and 2 of a group of 4 join; rank 3 never comes.
    receivers = [_in_thread(lambda r=rank: _receive_updates(port, r, 4, 1, timeout=3)) for rank in (1, 2)]
    sender = CollectiveWeightSender("localhost", port, timeout=1.5, backend="gloo")
    with pytest.raises(TimeoutError, match=r"sender .*rank\(s\) 3 did not join within 1.5s"):
        sender.send(1, _weights(1))
    sender.close()
    for thread, outcome in receivers:
        thread.join(timeout=30)
        assert isinstance(outcome.error, TimeoutError), outcome.error
        assert "rank(s) 3 " in str(outcome.error)


def test_two_workers_claiming_one_rank_are_refused() -> None:
    port = _free_port()
    first = _in_thread(lambda: _receive_updates(port, 1, 2, num_updates=1, timeout=30))
    sender = CollectiveWeightSender("localhost", port, timeout=30, backend="gloo")
    sender.connect()  # the group of 2 is complete: the trainer and the first claimer of rank 1
    with pytest.raises(ValueError, match=r"rank 1 was already taken.*tp or dp > 1"):
        _receive_updates(port, 1, 2, num_updates=1, timeout=5)
    sender.send(1, _weights(1))
    sender.close()
    first[0].join(timeout=30)
    assert first[1].error is None and first[1].value[0][0] == 1


def test_receiver_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank 3 is outside 1\.\.2"):
        CollectiveWeightReceiver("localhost", 1, timeout=1, rank=3, world_size=3)


# -- the inference worker's side ---------------------------------------------------------------


class _FakeModel:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> None:
        self.loaded.update(weights)


class _FakeWorker(WorkerExtension):
    """The worker extension on a stand-in for vLLM's worker: a model that records what it loads."""

    def __init__(self) -> None:
        self.model = _FakeModel()

    def _grpo_model(self) -> Any:
        return self.model


def test_workers_load_the_sent_version_and_a_repeated_request_is_a_no_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_compat, "repack_cpu_linear_weights", lambda model: 0)
    port = _free_port()
    workers = [_FakeWorker(), _FakeWorker()]
    threads = [
        _in_thread(lambda w=worker, r=rank: w.receive_weights_collective("localhost", port, 30.0, 1, r, 3))
        for rank, worker in enumerate(workers, 1)
    ]
    sender = CollectiveWeightSender("localhost", port, timeout=30, backend="gloo")
    sender.send(1, _weights(1))
    sender.close()
    for (thread, outcome), worker in zip(threads, workers, strict=True):
        thread.join(timeout=30)
        assert outcome.error is None and outcome.value == len(_weights(1))
        assert torch.equal(worker.model.loaded["step_counter"], torch.tensor([1, -1]))
    # A restarted orchestrator asks again for version 1: no session is opened (port 1 is never dialled).
    assert workers[0].receive_weights_collective("localhost", 1, 0.1, 1, 1, 3) == 0


# -- the orchestrator's client ------------------------------------------------------------------


def _collective_client(
    tmp_path: Path, handler: Callable[[httpx.Request], httpx.Response], urls: list[str]
) -> tuple[InferenceClient, str]:
    folder = tmp_path / "step_3"
    folder.mkdir()
    write_collective_manifest(folder, 3, "trainer-host", 29555, num_tensors=5, num_bytes=100)
    client = InferenceClient(
        ClientConfig(base_url=urls, max_retries=1),
        transport=httpx.MockTransport(handler),
        weight_broadcast=NcclWeightBroadcast(type="nccl", host="trainer-host", port=29555, timeout=7),
    )
    return client, str(folder)


def test_client_gives_each_server_its_rank_and_the_world_size(tmp_path: Path) -> None:
    bodies: dict[str, dict[str, object]] = {}

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.url.path == "/v1" + weight_routes.RECEIVE_WEIGHTS_ROUTE.removeprefix("/v1")
        bodies[req.url.host] = json.loads(req.content)
        return httpx.Response(200, json={"results": [5]})

    client, folder = _collective_client(tmp_path, handler, ["http://a/v1", "http://b/v1"])
    asyncio.run(client.update_weights(folder))
    common = {"host": "trainer-host", "port": 29555, "timeout": 7, "version": 3, "world_size": 3}
    assert bodies == {"a": {**common, "rank": 1}, "b": {**common, "rank": 2}}


def test_client_names_a_server_that_is_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "RETRY_BASE_DELAY_S", 0.0)

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "b":
            raise httpx.ConnectError("connection refused", request=req)
        await asyncio.Event().wait()  # server a waits for the trainer, which waits for b
        raise AssertionError("unreachable")

    client, folder = _collective_client(tmp_path, handler, ["http://a/v1", "http://b/v1"])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"server http://b/v1 \(rank 2 of 3\) did not receive policy 3"):
        asyncio.run(client.update_weights(folder))


# -- the trainer's side -------------------------------------------------------------------------


def test_publish_sends_the_full_weights_to_every_receiver_without_the_tied_alias(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.model import Policy
    from grpo.trainer.publish import publish_over_collective
    from grpo.transport.weights_announce import read_collective_manifest

    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    policy = Policy(causal_lm, causal_lm, torch.device("cpu"), torch.float32, None, is_lora=False)
    with torch.no_grad():  # values a freshly loaded receiver cannot already hold
        for param in causal_lm.parameters():
            param.add_(1.0)
    gathered = causal_lm.state_dict()
    port = _free_port()
    cfg = TrainerConfig.model_validate(
        {"model": "tiny", "lora": False, "weight_broadcast": {"type": "nccl", "port": port, "timeout": 60}}
    )
    receivers = [_in_thread(lambda r=rank: _receive_updates(port, r, 3, num_updates=1)) for rank in (1, 2)]
    folder = publish_over_collective(policy, cfg, tmp_path, version=1)
    manifest = read_collective_manifest(folder)
    assert manifest is not None and manifest["version"] == 1
    for thread, outcome in receivers:
        thread.join(timeout=60)
        assert outcome.error is None, outcome.error
        ((step, named),) = outcome.value
        received = dict(named)
        assert step == 1 and "lm_head.weight" not in received
        assert set(received) == set(gathered) - {"lm_head.weight"}
        assert all(torch.equal(received[name], gathered[name]) for name in received)
    assert manifest["num_tensors"] == len(gathered) - 1
