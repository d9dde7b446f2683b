"""Merged LoRA serving: the adapter -> fused-layer plan, and a real engine serving base + B @ A.

The vLLM tests use the session's adapter-serving server (conftest): the merge route works there
too, so one engine gives both the adapter path and the merged weights for the same adapter.
Each test serves the base weights again when it ends (unmerge_lora), for the tests after it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file
from server_client import with_client

from grpo.inference.lora_merge import merge_plan, merged_weight
from grpo.inference.policy_replay import MERGE_LORA_PATH
from grpo.inference.server import ServerThread
from grpo.inference.types import GenerateRequest, SamplingParams
from grpo.utils.device import cuda_present

MODEL = "tiny"
PROMPT = [1, 504, 3458, 282, 4195, 314, 260, 3436, 28, 1159]
LOGPROB_TOLERANCE = 0.05
"""Max abs logprob difference, adapter path vs merged weights. The shared server runs the tiny model
in bfloat16: the merged weight is rounded to bf16 once, the adapter path rounds base(x) and the
LoRA term apart; measured 6.9e-3 (sampled) and 1.3e-2 (scored) here, against ~1 between base and
adapter (the adapters move logprobs a lot)."""
MERGED_LAYERS = 8
"""Tiny model: 2 layers x (qkv_proj, o_proj, gate_up_proj, down_proj), all targeted by the adapters."""

# -- the plan (no engine) ---------------------------------------------------------------------

LAYER = "model.layers.0.self_attn"
ENGINE_LAYERS = {f"{LAYER}.qkv_proj": [8, 4, 4], f"{LAYER}.o_proj": [8]}


def write_adapter(folder: Path, config: dict[str, object], modules: dict[str, tuple[int, int]]) -> Path:
    """A PEFT-format adapter: `modules` maps HF module name -> (out rows, in features)."""
    folder.mkdir(parents=True)
    rank = int(config.get("r", 2))  # type: ignore[call-overload]
    tensors = {}
    for i, (module, (rows, cols)) in enumerate(modules.items()):
        generator = torch.Generator().manual_seed(i)
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, cols, generator=generator)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, rank, generator=generator)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 4, **config}))
    return folder


def test_q_and_v_updates_land_on_their_rows_of_the_fused_qkv_with_peft_scaling(tmp_path: Path) -> None:
    adapter = write_adapter(
        tmp_path / "a",
        {"r": 2, "use_rslora": True, "alpha_pattern": {"o_proj": 8}},
        {f"{LAYER}.q_proj": (8, 8), f"{LAYER}.v_proj": (4, 8), f"{LAYER}.o_proj": (8, 8)},
    )
    plan = merge_plan(adapter, ENGINE_LAYERS)
    qkv = {u.row_offset: u for u in plan[f"{LAYER}.qkv_proj"]}
    assert sorted(qkv) == [0, 12]  # q at row 0, v after q (8) and k (4); k untouched
    assert qkv[0].scaling == pytest.approx(4 / math.sqrt(2))  # rslora: alpha / sqrt(r)
    (o_update,) = plan[f"{LAYER}.o_proj"]
    assert o_update.scaling == pytest.approx(8 / math.sqrt(2))  # alpha_pattern

    base = torch.randn(16, 8)
    before = base.clone()
    merged = merged_weight(base, plan[f"{LAYER}.qkv_proj"])
    assert torch.equal(base, before)  # the base is read, never written
    expected = before.clone()
    expected[0:8] += qkv[0].scaling * qkv[0].lora_b @ qkv[0].lora_a
    expected[12:16] += qkv[12].scaling * qkv[12].lora_b @ qkv[12].lora_a
    torch.testing.assert_close(merged, expected)


@pytest.mark.parametrize(
    ("config", "modules", "match"),
    [
        ({"use_dora": True}, {f"{LAYER}.q_proj": (8, 8)}, "DoRA"),
        ({}, {"lm_head": (8, 8)}, "no linear layer in the engine"),
        ({}, {f"{LAYER}.k_proj": (8, 8)}, "has 4 rows"),
    ],
)
def test_adapters_that_cannot_merge_are_refused_with_the_reason(
    tmp_path: Path, config: dict[str, object], modules: dict[str, tuple[int, int]], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        merge_plan(write_adapter(tmp_path / "a", config, modules), ENGINE_LAYERS)


@pytest.mark.skipif(cuda_present(), reason="vLLM's CPU GEMM dispatch")
@pytest.mark.parametrize("out_features", [64, 1536])  # small and large GEMMs take different CPU kernels
def test_the_cpu_kernel_computes_with_the_merged_weight_and_the_parameter_is_not_written(
    out_features: int,
) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from grpo.inference.vllm_compat.cpu_weights import pack_cpu_linear_weight

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(
        torch.randn(out_features, 256, dtype=torch.bfloat16), requires_grad=False
    )
    layer.bias = None
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    base = layer.weight.detach().clone()
    merged = (base.float() + torch.randn_like(base, dtype=torch.float32)).to(torch.bfloat16)
    x = torch.randn(3, 256, dtype=torch.bfloat16)

    pack_cpu_linear_weight(layer, merged)
    # vLLM passes the layer's own (base) parameter; the merged weight must be used regardless.
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), x @ merged.T, rtol=2e-2, atol=2e-1)
    assert torch.equal(layer.weight, base)
    pack_cpu_linear_weight(layer, layer.weight)  # back to the base
    torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), x @ base.T, rtol=2e-2, atol=2e-1)


# -- a real engine ----------------------------------------------------------------------------


def sample(server: ServerThread, model: str) -> tuple[list[int], list[float]]:
    request = GenerateRequest(
        prompt_token_ids=PROMPT,
        params=SamplingParams(temperature=1.0, max_tokens=16, min_tokens=16, seed=5),
        model=model,
        cache_salt=f"salt-{model}",
    )
    (completion,) = with_client(server, lambda client: client.generate(request))
    return completion.token_ids, completion.logprobs


def score(server: ServerThread, model: str, token_ids: list[int]) -> list[float]:
    return list(with_client(server, lambda client: client.prompt_logprobs(token_ids, model)))


def merge(server: ServerThread, name: str, adapter: Path) -> None:
    response = httpx.post(
        server.base_url + MERGE_LORA_PATH, json={"lora_name": name, "lora_path": str(adapter)}, timeout=120
    )
    assert response.status_code == 200, response.text
    assert response.json()["results"] == [MERGED_LAYERS]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def serves_base_after(vllm_server: ServerThread) -> Iterator[ServerThread]:
    try:
        yield vllm_server
    finally:
        vllm_server.collective_rpc("unmerge_lora")


@pytest.mark.vllm
def test_merged_weights_sample_the_adapters_tokens_with_its_logprobs(
    serves_base_after: ServerThread, adapter_dirs: tuple[Path, Path]
) -> None:
    server = serves_base_after
    adapter_a, _ = adapter_dirs
    base_tokens, _ = sample(server, MODEL)
    base_scores = score(server, MODEL, PROMPT + base_tokens)
    with_client(server, lambda client: client.load_lora_adapter("merge-test-lora", str(adapter_a)))
    lora_tokens, lora_logprobs = sample(server, "merge-test-lora")
    lora_scores = score(server, "merge-test-lora", PROMPT + lora_tokens)

    merge(server, "merge-test-merged", adapter_a)
    # The adapter's name now runs as the base model (no LoRA request), like the base name itself.
    for name in ("merge-test-merged", MODEL):
        tokens, logprobs = sample(server, name)
        assert tokens == lora_tokens
        sampled_diff = max_abs_diff(logprobs, lora_logprobs)
        scored_diff = max_abs_diff(score(server, name, PROMPT + tokens)[1:], lora_scores[1:])
        print(
            f"{name}: max abs logprob diff adapter vs merged: sampled {sampled_diff:.2e}, scored {scored_diff:.2e}"
        )
        assert sampled_diff < LOGPROB_TOLERANCE and scored_diff < LOGPROB_TOLERANCE
    # Not the base: the adapter's effect is far above the merge's rounding.
    assert max_abs_diff(score(server, MODEL, PROMPT + base_tokens), base_scores) > 10 * LOGPROB_TOLERANCE

    assert server.collective_rpc("unmerge_lora") == [MERGED_LAYERS]
    assert max_abs_diff(score(server, MODEL, PROMPT + base_tokens), base_scores) < 1e-5


@pytest.mark.vllm
def test_a_second_merge_starts_from_the_base_not_from_the_first_merge(
    serves_base_after: ServerThread, adapter_dirs: tuple[Path, Path]
) -> None:
    server = serves_base_after
    adapter_a, adapter_b = adapter_dirs
    tokens, _ = sample(server, MODEL)
    merge(server, "merge-test-merged", adapter_a)
    a_scores = score(server, MODEL, PROMPT + tokens)
    merge(server, "merge-test-merged", adapter_b)
    b_after_a = score(server, MODEL, PROMPT + tokens)
    server.collective_rpc("unmerge_lora")
    merge(server, "merge-test-merged", adapter_b)
    b_alone = score(server, MODEL, PROMPT + tokens)
    # The same computation from the same base: identical, so nothing of adapter A remains.
    assert b_after_a == b_alone
    assert max_abs_diff(b_alone[1:], a_scores[1:]) > 10 * LOGPROB_TOLERANCE


@pytest.mark.vllm
def test_merging_leaves_the_borrowed_base_weights_bit_for_bit(
    serves_base_after: ServerThread,
    adapter_dirs: tuple[Path, Path],
    shm_records_to_release: list[dict[str, Any]],
) -> None:
    from grpo.inference.weight_handles import rebuild_tensor

    server = serves_base_after
    (records,) = server.collective_rpc("export_weight_handles")
    shm_records_to_release.extend(records)  # other tests export from this server after this one
    borrowed = {record["name"]: rebuild_tensor(record) for record in records}
    before = {name: tensor.clone() for name, tensor in borrowed.items()}
    merge(server, "merge-test-merged", adapter_dirs[0])
    changed = [name for name, tensor in borrowed.items() if not torch.equal(tensor, before[name])]
    assert any("qkv_proj" in name for name in borrowed)
    assert changed == []
