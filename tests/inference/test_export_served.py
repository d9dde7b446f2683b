"""What `grpo export` writes, served by vLLM: the adapter alone through load_lora_adapter, the
merged model as the served weights; both give the same logprobs (the session's tiny-model server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_client import with_client
from trained_runs import train_and_publish

from grpo.inference.server import ServerThread
from grpo.models.export import stored_dtype, write_adapter, write_merged
from grpo.transport.weights.filesystem import broadcast_dir

pytestmark = pytest.mark.vllm

MODEL = "tiny"
PROMPT = [1, 504, 3458, 282, 4195, 314, 260, 3436, 28, 1159]
LOGPROB_TOLERANCE = 0.05
"""Max abs logprob difference, adapter path vs merged weights: in bfloat16 (the server's dtype on a
CPU with native bf16; float32, closer still, on one without), the
merged weight is rounded once and the adapter path rounds base(x) and the LoRA term apart
(tests/inference/test_lora_merge.py measured 7e-3 to 1.3e-2); the trained adapter moves them by
more than 0.2."""


@pytest.fixture(scope="module")
def exported(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(adapter folder, merged model folder) of a run trained one step with LoRA; under the
    session's basetemp, the only place the shared server's weight routes load from."""
    root = tmp_path_factory.mktemp("export_served")
    train_and_publish(root / "run", tiny_model_path, lora=True, learning_rate=5e-2)
    policy = broadcast_dir(root / "run", 1)
    write_adapter(policy, root / "adapter")
    write_merged(policy, "adapter", tiny_model_path, root / "merged", stored_dtype(tiny_model_path))
    return root / "adapter", root / "merged"


def score(server: ServerThread, model: str) -> list[float]:
    return with_client(server, lambda client: client.prompt_logprobs(PROMPT, model))


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_exported_adapter_and_merged_weights_are_served_with_the_same_logprobs(
    vllm_server: ServerThread, tiny_model_path: Path, exported: tuple[Path, Path]
) -> None:
    adapter, merged_model = exported
    base = score(vllm_server, MODEL)

    with_client(vllm_server, lambda client: client.load_lora_adapter("exported", str(adapter)))
    with_adapter = score(vllm_server, "exported")
    with_client(vllm_server, lambda client: client.update_weights(str(merged_model)))
    try:
        merged = score(vllm_server, MODEL)
    finally:
        with_client(vllm_server, lambda client: client.update_weights(str(tiny_model_path)))

    assert max_abs_diff(with_adapter, base) > 0.2
    assert max_abs_diff(merged, with_adapter) < LOGPROB_TOLERANCE
