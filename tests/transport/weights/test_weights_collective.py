"""Full weights trainer -> inference workers over gloo: one sender, one or several receivers;
peers prove a shared secret, and a receiver takes only what the served model has."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from free_ports import free_port
from safetensors.torch import load_file

import grpo.inference.retry as retry
from grpo.config.orchestrator import ClientConfig, NcclWeightBroadcast
from grpo.inference import weight_routes
from grpo.inference.client import InferenceClient
from grpo.inference.vllm_compat import cpu_weights
from grpo.inference.worker_extension import WorkerExtension, hf_checkpoint_shapes
from grpo.transport.weights.announce import write_collective_manifest
from grpo.transport.weights.collective import (
    DEFAULT_SECRET_ENV,
    CollectiveWeightReceiver,
    CollectiveWeightSender,
)
from grpo.transport.weights.manifest import check_manifest
from grpo.transport.weights.signed_manifest import manifest_payload
from grpo.utils.auth import sign
from grpo.utils.errors import UserError

SECRET_ENV = "GRPO_TEST_WEIGHTS_SECRET"
ROGUE_SECRET_ENV = "GRPO_TEST_ROGUE_SECRET"
UNSET_ENV = "GRPO_TEST_UNSET_SECRET"


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """No secret (loopback) unless a test names SECRET_ENV, whatever the developer's shell holds."""
    monkeypatch.delenv(DEFAULT_SECRET_ENV, raising=False)
    monkeypatch.delenv(UNSET_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, "the-shared-secret-" + "s" * 32)
    monkeypatch.setenv(ROGUE_SECRET_ENV, "a-guessed-secret-" + "r" * 32)


def _start_receiver_process(port: int, out_dir: Path, num_updates: int) -> subprocess.Popen:
    """An inference-worker stand-in that saves every update it receives as safetensors."""
    script = textwrap.dedent(
        f"""
        from safetensors.torch import save_file
        from grpo.transport.weights.collective import CollectiveWeightReceiver
        receiver = CollectiveWeightReceiver("localhost", {port}, timeout=60, backend="gloo")
        for _ in range({num_updates}):
            step, named = receiver.receive(expected=None)
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
    port = free_port()
    receiver_process = _start_receiver_process(port, tmp_path, num_updates=2)
    sender = CollectiveWeightSender("localhost", port, timeout=60, num_servers=1, backend="gloo")
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
    port = free_port()
    sender = CollectiveWeightSender("localhost", port, timeout=0.5, num_servers=1, backend="gloo")
    with pytest.raises(TimeoutError, match=rf"localhost:{port}.*no receiver \(inference server\) joined"):
        sender.send(1, _weights(1))
    sender.close()


def test_receiver_without_sender_times_out_naming_address_and_peer() -> None:
    port = free_port()
    receiver = CollectiveWeightReceiver("localhost", port, timeout=0.5, backend="gloo")
    with pytest.raises(TimeoutError, match=rf"localhost:{port}.*sender \(trainer\)"):
        receiver.receive(expected=None)


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


def _receive_updates(
    port: int,
    rank: int,
    world_size: int,
    num_updates: int,
    timeout: float = 60,
    secret_env: str = DEFAULT_SECRET_ENV,
    expected: dict[str, tuple[int, ...]] | None = None,
) -> Any:
    receiver = CollectiveWeightReceiver(
        "localhost",
        port,
        timeout=timeout,
        backend="gloo",
        rank=rank,
        world_size=world_size,
        secret_env=secret_env,
    )
    try:
        return [receiver.receive(expected=expected) for _ in range(num_updates)]
    finally:
        receiver.close()


def test_three_receivers_get_identical_weights_for_two_versions() -> None:
    port = free_port()
    receivers = [_in_thread(lambda r=rank: _receive_updates(port, r, 4, num_updates=2)) for rank in (1, 2, 3)]
    sender = CollectiveWeightSender("localhost", port, timeout=60, num_servers=3, backend="gloo")
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
    port = free_port()
    # Ranks 1 and 2 of a group of 4 join; rank 3 never comes.
    receivers = [_in_thread(lambda r=rank: _receive_updates(port, r, 4, 1, timeout=3)) for rank in (1, 2)]
    sender = CollectiveWeightSender("localhost", port, timeout=1.5, num_servers=3, backend="gloo")
    with pytest.raises(TimeoutError, match=r"sender .*rank\(s\) 3 did not join within 1.5s"):
        sender.send(1, _weights(1))
    sender.close()
    for thread, outcome in receivers:
        thread.join(timeout=30)
        assert isinstance(outcome.error, TimeoutError), outcome.error
        assert "rank(s) 3 " in str(outcome.error)


def test_two_workers_claiming_one_rank_are_refused() -> None:
    port = free_port()
    first = _in_thread(lambda: _receive_updates(port, 1, 2, num_updates=1, timeout=30))
    sender = CollectiveWeightSender("localhost", port, timeout=30, num_servers=1, backend="gloo")
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


# -- peers prove the shared secret ---------------------------------------------------------------


def test_peers_holding_the_same_secret_exchange_weights() -> None:
    port = free_port()
    receivers = [
        _in_thread(lambda r=rank: _receive_updates(port, r, 3, num_updates=1, secret_env=SECRET_ENV))
        for rank in (1, 2)
    ]
    sender = CollectiveWeightSender(
        "localhost", port, timeout=60, num_servers=2, backend="gloo", secret_env=SECRET_ENV
    )
    try:
        sender.send(1, _weights(1))
    finally:
        sender.close()
    for thread, outcome in receivers:
        thread.join(timeout=60)
        assert outcome.error is None, outcome.error
        ((step, named),) = outcome.value
        assert step == 1 and all(
            torch.equal(got, want) for (_, got), (_, want) in zip(named, _weights(1), strict=True)
        )


@pytest.mark.parametrize("rogue_secret_env", [UNSET_ENV, ROGUE_SECRET_ENV], ids=["no_secret", "wrong_secret"])
def test_a_receiver_that_cannot_prove_the_secret_gets_no_weights_and_is_named_at_the_deadline(
    rogue_secret_env: str,
) -> None:
    port = free_port()
    rogue = _in_thread(
        lambda: _receive_updates(port, 1, 2, num_updates=1, timeout=5, secret_env=rogue_secret_env)
    )
    sender = CollectiveWeightSender(
        "localhost", port, timeout=3, num_servers=1, backend="gloo", secret_env=SECRET_ENV
    )
    with pytest.raises(ValueError, match=rf"rank 1 did not prove it holds the secret in \${SECRET_ENV}"):
        sender.send(1, _weights(1))
    sender.close()
    rogue[0].join(timeout=30)
    assert rogue[1].value is None, "the refused receiver got weights"
    # It looked for the challenge under keys its own secret (or none) names: there was none.
    assert "the trainer's challenge" in str(rogue[1].error) and "did not appear" in str(rogue[1].error)


class _StoreThatChecksNoOne(CollectiveWeightSender):
    """A rogue trainer: answers every receiver with a proof made with whatever secret it has."""

    def _answer(self, store: Any, rank: int, raw_hello: bytes) -> bool:
        nonce = json.loads(raw_hello)["nonce"]
        store.set(self._key(f"rank{rank}_verdict"), json.dumps({"proof": self._proof("sender", nonce, rank)}))
        return True


@pytest.mark.parametrize("rogue_secret_env", [UNSET_ENV, ROGUE_SECRET_ENV], ids=["no_secret", "wrong_secret"])
def test_a_receiver_takes_no_challenge_from_a_store_without_the_secret(rogue_secret_env: str) -> None:
    port = free_port()
    rogue = _StoreThatChecksNoOne(
        "localhost", port, timeout=3, num_servers=1, backend="gloo", secret_env=rogue_secret_env
    )
    rogue_sends = _in_thread(lambda: rogue.send(1, _weights(1)))
    with pytest.raises(
        TimeoutError,
        match=rf"challenge for the secret in \${SECRET_ENV} did not appear.*holds the same secret",
    ):
        _receive_updates(port, 1, 2, num_updates=1, timeout=3, secret_env=SECRET_ENV)
    rogue_sends[0].join(timeout=30)
    # The receiver never became ready: the rogue times out, or names the rank knocking with another secret.
    assert isinstance(rogue_sends[1].error, (TimeoutError, UserError)), rogue_sends[1].error
    rogue.close()


def test_a_receiver_needs_a_secret_to_join_a_store_on_another_machine() -> None:
    with pytest.raises(ValueError) as err:
        CollectiveWeightReceiver("10.0.0.5", 29501, timeout=1, secret_env=UNSET_ENV)
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and f"export {UNSET_ENV}=" in lines[0] and "127.0.0.1" in lines[0], lines


def test_a_receiver_told_another_world_size_is_refused_by_both_sides() -> None:
    port = free_port()
    receiver = _in_thread(lambda: _receive_updates(port, 1, 3, num_updates=1, timeout=30))
    sender = CollectiveWeightSender("localhost", port, timeout=30, num_servers=1, backend="gloo")
    with pytest.raises(ValueError, match=r"rank 1 was told world size 3 .*num_servers 1 makes it 2"):
        sender.send(1, _weights(1))
    sender.close()
    receiver[0].join(timeout=30)
    assert isinstance(receiver[1].error, ValueError)
    assert "gave world size 3 (2 server(s)), but the trainer's weight_broadcast.num_servers is 1" in str(
        receiver[1].error
    )


class _SenderThatLies(CollectiveWeightSender):
    """Announces `manifest` (signed with its tag, or a tag over another document) and sends nothing."""

    def __init__(
        self, *args: Any, manifest: dict[str, Any], sign_another: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.manifest, self.sign_another = manifest, sign_another

    def send(self, step: int, named_tensors: Any) -> None:
        self.connect()
        text = json.dumps(self.manifest)
        if self.sign_another:
            # The tag first, over another document, then this one: a receiver never sees a valid pair.
            other = json.dumps({**self.manifest, "step": step + 1})
            assert self._secret is not None
            self._store.set(
                "update/0/tag", sign(self._secret, manifest_payload(self._session_nonce, 0, other)).hex()
            )
            self._store.set("update/0", text)
        else:
            self._publish_manifest(text)


def _receive_from_liar(liar: _SenderThatLies, port: int, expected: dict[str, tuple[int, ...]] | None) -> None:
    liar_sends = _in_thread(lambda: liar.send(1, []))
    try:
        _receive_updates(port, 1, 2, num_updates=1, timeout=30, secret_env=SECRET_ENV, expected=expected)
    finally:
        liar_sends[0].join(timeout=30)
        liar.close()


def test_a_manifest_not_signed_with_the_secret_is_refused() -> None:
    port = free_port()
    manifest = {"step": 1, "bucket_bytes": 2**20, "tensors": [["model.norm.weight", "float32", [8]]]}
    liar = _SenderThatLies(
        "localhost",
        port,
        30,
        num_servers=1,
        backend="gloo",
        secret_env=SECRET_ENV,
        manifest=manifest,
        sign_another=True,
    )
    with pytest.raises(ValueError, match=r"update 0's manifest is not signed with the secret"):
        _receive_from_liar(liar, port, expected={"model.norm.weight": (8,)})


def test_a_signed_manifest_without_a_digest_per_bucket_is_refused() -> None:
    port = free_port()
    manifest = {"step": 1, "bucket_bytes": 2**20, "tensors": [["model.norm.weight", "float32", [8]]]}
    liar = _SenderThatLies(
        "localhost", port, 30, num_servers=1, backend="gloo", secret_env=SECRET_ENV, manifest=manifest
    )
    with pytest.raises(ValueError, match=r"update 0's manifest does not give one digest per bucket \(1\)"):
        _receive_from_liar(liar, port, expected={"model.norm.weight": (8,)})


def test_a_huge_shape_is_refused_before_anything_is_allocated() -> None:
    port = free_port()
    huge = [2**31, 2**31]  # 16 EiB of float32: torch.empty would fail with a RuntimeError, not this
    manifest = {"step": 1, "bucket_bytes": 2**20, "tensors": [["model.norm.weight", "float32", huge]]}
    liar = _SenderThatLies(
        "localhost", port, 30, num_servers=1, backend="gloo", secret_env=SECRET_ENV, manifest=manifest
    )
    with pytest.raises(
        ValueError, match=r"tensor 'model.norm.weight' shape \[2147483648, 2147483648\], but the served"
    ):
        _receive_from_liar(liar, port, expected={"model.norm.weight": (8,)})


# -- the manifest against the served model ---------------------------------------------------------

_SHAPES = {"model.embed_tokens.weight": (32, 8), "model.norm.weight": (8,)}


def test_a_manifest_that_fits_the_model_gives_the_step_and_each_tensor() -> None:
    manifest = {
        "step": 7,
        "tensors": [
            ["model.norm.weight", "bfloat16", [8]],
            ["model.embed_tokens.weight", "float32", [32, 8]],
        ],
    }
    assert check_manifest(manifest, _SHAPES) == (
        7,
        [("model.norm.weight", torch.bfloat16, [8]), ("model.embed_tokens.weight", torch.float32, [32, 8])],
    )


@pytest.mark.parametrize(
    ("tensors", "refusal"),
    [
        (
            [["model.norm.weight", "float32", [9]]],
            r"'model.norm.weight' shape \[9\], but the served model's is \[8\]",
        ),
        (
            [["model.norm.weight", "float32", [2**40, 2**40]]],
            r"'model.norm.weight' shape \[1099511627776, 1099511627776\]",
        ),
        ([["lm_head.extra", "float32", [8]]], r"'lm_head.extra', which the served model does not have"),
        (
            [["model.norm.weight", "float32", [8]], ["model.norm.weight", "float32", [8]]],
            r"'model.norm.weight' twice",
        ),
        (
            [["model.norm.weight", "int64", [8]]],
            r"'model.norm.weight' dtype int64; model weights are floating point",
        ),
        ([["model.norm.weight", "complex64", [8]]], r"'model.norm.weight' unsupported dtype 'complex64'"),
        ([["model.norm.weight", "float32", [-8]]], r"is not \[name, dtype, \[sizes >= 0\]\]"),
        ([["model.norm.weight", "float32"]], r"is not \[name, dtype, \[sizes >= 0\]\]"),
    ],
    ids=[
        "wrong_shape",
        "huge_shape",
        "unknown_name",
        "duplicate_name",
        "integer_dtype",
        "unknown_dtype",
        "negative_size",
        "no_shape",
    ],
)
def test_a_manifest_that_does_not_fit_the_model_is_refused_naming_the_tensor(
    tensors: list[Any], refusal: str
) -> None:
    with pytest.raises(ValueError, match=refusal):
        check_manifest({"step": 1, "tensors": tensors}, _SHAPES)


@pytest.mark.parametrize(
    "manifest", [[], {"tensors": []}, {"step": "1", "tensors": []}, {"step": 1, "tensors": {}}]
)
def test_a_malformed_manifest_is_refused(manifest: object) -> None:
    with pytest.raises(ValueError, match=r"manifest is not \{\"step\": int"):
        check_manifest(manifest, _SHAPES)


# -- the inference worker's side ---------------------------------------------------------------


def _tiny_config(hidden_size: int = 16) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32,
        hidden_size=hidden_size,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )


def _model_weights(config: Any, step: int) -> list[tuple[str, torch.Tensor]]:
    """What a trainer sends for a model of `config`: every checkpoint tensor (here random), but
    the tied lm_head."""
    generator = torch.Generator().manual_seed(step)
    shapes = hf_checkpoint_shapes(config)
    return [
        (name, torch.randn(shape, generator=generator))
        for name, shape in shapes.items()
        if name != "lm_head.weight"
    ]


class _FakeModel:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> None:
        self.loaded.update(weights)

    def named_parameters(self) -> Any:  # a dense model: no packed CPU experts to refuse
        return iter(())

    def modules(self) -> Any:  # no layers: no float32 head copy to drop after the load
        return iter(())


class _FakeWorker(WorkerExtension):
    """The worker extension on a stand-in for vLLM's worker: serves a model of `config` that
    records what it loads."""

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        self.model = _FakeModel()
        self.config = config
        self.model_config = SimpleNamespace(dtype=dtype)

    def _grpo_model(self) -> Any:
        return self.model

    def _grpo_hf_config(self) -> tuple[Any, bool]:
        return self.config, False


def test_workers_load_the_sent_version_and_a_repeated_request_is_a_no_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_weights, "repack_cpu_linear_weights", lambda model: 0)
    port = free_port()
    config = _tiny_config()
    workers = [_FakeWorker(config), _FakeWorker(config)]
    threads = [
        _in_thread(
            lambda w=worker, r=rank: w.receive_weights_collective(
                "localhost", port, 30.0, 1, r, 3, SECRET_ENV
            )
        )
        for rank, worker in enumerate(workers, 1)
    ]
    sender = CollectiveWeightSender(
        "localhost", port, timeout=30, num_servers=2, backend="gloo", secret_env=SECRET_ENV
    )
    sent = _model_weights(config, step=1)
    sender.send(1, sent)
    sender.close()
    for (thread, outcome), worker in zip(threads, workers, strict=True):
        thread.join(timeout=30)
        assert outcome.error is None and outcome.value == len(sent)
        assert all(torch.equal(worker.model.loaded[name], tensor) for name, tensor in sent)
    # A restarted orchestrator asks again for version 1: no session is opened (port 1 is never dialled).
    assert workers[0].receive_weights_collective("localhost", 1, 0.1, 1, 1, 3, SECRET_ENV) == 0


def test_a_worker_refuses_the_weights_of_another_model_and_loads_nothing() -> None:
    port = free_port()
    worker = _FakeWorker(_tiny_config(hidden_size=16))
    receiving = _in_thread(lambda: worker.receive_weights_collective("localhost", port, 30.0, 1, 1, 2))
    sender = CollectiveWeightSender("localhost", port, timeout=5, num_servers=1, backend="gloo")
    sending = _in_thread(lambda: sender.send(1, _model_weights(_tiny_config(hidden_size=24), step=1)))
    receiving[0].join(timeout=30)
    assert isinstance(receiving[1].error, ValueError)
    assert "tensor 'model.embed_tokens.weight' shape [32, 24], but the served model's is [32, 16]" in str(
        receiving[1].error
    )
    assert worker.model.loaded == {}
    sending[0].join(timeout=30)  # its broadcast fails or times out: the receiver has left
    sender.close()


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
        weight_broadcast=NcclWeightBroadcast(
            type="nccl",
            host="trainer-host",
            port=29555,
            timeout=7,
            num_servers=len(urls),
            secret_env=SECRET_ENV,
        ),
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
    # The secret stays in each side's environment: never in the request.
    common = {"host": "trainer-host", "port": 29555, "timeout": 7, "version": 3, "world_size": 3}
    assert bodies == {"a": {**common, "rank": 1}, "b": {**common, "rank": 2}}


def test_client_names_a_server_that_is_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "RETRY_BASE_DELAY_S", 0.0)

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "b":
            raise httpx.ConnectError("connection refused", request=req)
        await asyncio.Event().wait()  # server a waits for the trainer, which waits for b
        raise AssertionError("unreachable")

    client, folder = _collective_client(tmp_path, handler, ["http://a/v1", "http://b/v1"])  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"server http://b/v1 \(rank 2 of 3\) did not receive policy 3"):
        asyncio.run(client.update_weights(folder))


# -- the trainer's side -------------------------------------------------------------------------


def test_publish_sends_the_full_weights_the_served_model_expects_to_every_receiver_without_the_tied_alias(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.model import Policy
    from grpo.trainer.hf.publish import publish_over_collective
    from grpo.transport.weights.announce import read_collective_manifest

    causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    policy = Policy(causal_lm, causal_lm, torch.device("cpu"), torch.float32, None, is_lora=False)
    with torch.no_grad():  # values a freshly loaded receiver cannot already hold
        for param in causal_lm.parameters():
            param.add_(1.0)
    gathered = causal_lm.state_dict()
    port = free_port()
    collective = {"type": "nccl", "port": port, "timeout": 60, "num_servers": 2, "secret_env": SECRET_ENV}
    cfg = TrainerConfig.model_validate({"model": "tiny", "lora": False, "weight_broadcast": collective})
    expected = hf_checkpoint_shapes(causal_lm.config)  # what a server of this model accepts
    receivers = [
        _in_thread(
            lambda r=rank: _receive_updates(
                port, r, 3, num_updates=1, secret_env=SECRET_ENV, expected=expected
            )
        )
        for rank in (1, 2)
    ]
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
