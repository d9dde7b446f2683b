"""The vLLM server on CPU with the tiny model, driven through InferenceClient."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from server_client import with_client

from grpo.inference.client import InferenceClient
from grpo.inference.server import ServerThread
from grpo.inference.types import Completion, GenerateRequest, SamplingParams
from grpo.orchestrator.scheduler import PolicyTracker
from grpo.utils.atomic import mark_stable

pytestmark = pytest.mark.vllm

MODEL = "tiny"
PROMPT = [1, 504, 3458, 282, 4195, 314, 260, 3436, 28, 1159]


def score(server: ServerThread, model: str, token_ids: list[int] = PROMPT) -> list[float]:
    return with_client(server, lambda client: client.prompt_logprobs(token_ids, model))


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_completions_return_decodable_token_ids_and_one_finite_logprob_each(
    vllm_server: ServerThread, tiny_model_path: Path
) -> None:
    from transformers import AutoTokenizer

    request = GenerateRequest(
        prompt_token_ids=PROMPT, params=SamplingParams(temperature=1.0, max_tokens=12, seed=3), n=3, model=MODEL,
        cache_salt="v0",
    )  # fmt: skip
    completions = with_client(vllm_server, lambda client: client.generate(request))

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert len(completions) == 3
    for completion in completions:
        assert 0 < len(completion.token_ids) <= 12
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in completion.logprobs)
        assert tokenizer.decode(completion.token_ids, skip_special_tokens=True) == completion.text
    assert len({tuple(c.token_ids) for c in completions}) > 1, "n=3 samples of a random model should differ"


def sample(server: ServerThread, params: SamplingParams, salt: str) -> Completion:
    """One completion of PROMPT; its own cache salt, so no request reuses another's prefix cache."""
    request = GenerateRequest(prompt_token_ids=PROMPT, params=params, n=1, model=MODEL, cache_salt=salt)
    (completion,) = with_client(server, lambda client: client.generate(request))
    return completion


def test_a_stop_string_cuts_the_text_and_returns_every_token_sampled_with_its_logprob(
    vllm_server: ServerThread, tiny_model_path: Path
) -> None:
    """The rule docs/loss.md ("Stop strings") states: the tokens (and logprobs) that train are every
    token sampled, the one completing the stop string included even where its text runs past it; the
    text the rewards score is cut before the stop string, or after it with include_stop_str_in_output."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    seeded = SamplingParams(temperature=1.0, max_tokens=24, seed=5)
    full = sample(vllm_server, seeded, "stop-full")
    offsets = [len(tokenizer.decode(full.token_ids[:i], skip_special_tokens=True)) for i in range(25)]
    # a stop string that ends one character into token k (its text runs on) and appears nowhere earlier
    k, start = next(
        (k, max(0, offsets[k] - 3))
        for k in range(1, len(full.token_ids) - 1)
        if offsets[k + 1] - offsets[k] >= 2
        and full.text.find(full.text[max(0, offsets[k] - 3) : offsets[k] + 1]) == max(0, offsets[k] - 3)
    )
    stop = full.text[start : offsets[k] + 1]
    for include in (False, True):
        params = replace(seeded, stop=(stop,), include_stop_str_in_output=include)
        cut = sample(vllm_server, params, f"stop-{include}")
        assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
        assert cut.token_ids == full.token_ids[: k + 1]
        assert max_abs_diff(cut.logprobs, full.logprobs[: k + 1]) < 1e-4
        assert cut.text == full.text[: start + len(stop) if include else start]
        assert len(tokenizer.decode(cut.token_ids, skip_special_tokens=True)) > start + len(stop)

    j = next(j for j in range(2, len(full.token_ids)) if full.token_ids[j] not in full.token_ids[:j])
    for include in (False, True):
        params = replace(seeded, stop_token_ids=(full.token_ids[j],), include_stop_str_in_output=include)
        ended = sample(vllm_server, params, f"stop-id-{include}")
        assert (ended.finish_reason, ended.stop_reason) == ("stop", full.token_ids[j])
        assert ended.token_ids == full.token_ids[: j + 1]
        assert ended.text == tokenizer.decode(
            full.token_ids[: j + 1 if include else j], skip_special_tokens=True
        )


def test_prompt_logprobs_score_every_token_after_the_first(vllm_server: ServerThread) -> None:
    logprobs = score(vllm_server, MODEL)
    assert len(logprobs) == len(PROMPT)
    assert logprobs[0] == 0.0
    assert all(math.isfinite(lp) and lp < 0.0 for lp in logprobs[1:])


def test_hot_loaded_adapter_changes_outputs_and_same_name_reload_takes_effect(
    vllm_server: ServerThread, adapter_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    adapter_a, adapter_b = adapter_dirs
    base = score(vllm_server, MODEL)

    with_client(vllm_server, lambda client: client.load_lora_adapter("policy", str(adapter_a)))
    with_a = score(vllm_server, "policy")
    assert max_abs_diff(with_a, base) > 0.05

    # The published folder of a step is loaded, then may be deleted; it must not be re-read.
    copy_of_b = tmp_path / "step_2"
    shutil.copytree(adapter_b, copy_of_b)
    with_client(vllm_server, lambda client: client.load_lora_adapter("policy", str(copy_of_b)))
    with_b = score(vllm_server, "policy")
    assert max_abs_diff(with_b, with_a) > 0.05
    assert max_abs_diff(with_b, base) > 0.05

    shutil.rmtree(copy_of_b)
    assert score(vllm_server, "policy") == with_b
    assert score(vllm_server, MODEL) == base


def _checkpoint_state(model_path: Path) -> dict[str, Any]:
    """HF name -> tensor of every safetensors file of the checkpoint at `model_path`."""
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def test_full_weight_update_from_a_folder_changes_outputs_and_restores(
    vllm_server: ServerThread, tiny_model_path: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    original = score(vllm_server, MODEL)
    state = _checkpoint_state(tiny_model_path)
    zeroed_dir = tmp_path / "zeroed"
    zeroed_dir.mkdir()
    save_file({name: t.clone().zero_() for name, t in state.items()}, str(zeroed_dir / "model.safetensors"))

    with_client(vllm_server, lambda client: client.update_weights(str(zeroed_dir)))
    degenerate = score(vllm_server, MODEL)
    # All-zero weights give all-zero logits: every token equally likely.
    assert max(degenerate[1:]) - min(degenerate[1:]) < 1e-3
    assert max_abs_diff(degenerate, original) > 0.05

    with_client(vllm_server, lambda client: client.update_weights(str(tiny_model_path)))
    assert max_abs_diff(score(vllm_server, MODEL), original) < 1e-3


def _reference_logprobs(model_path: Path, state: dict[str, Any], token_ids: list[int]) -> list[float]:
    """Prompt logprobs of `model_path` with the weights `state`, in float32 (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, :-1]
    picked = logits.log_softmax(-1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return [0.0, *picked.tolist()]


def test_a_full_weight_update_of_the_tied_output_layer_is_what_the_engine_scores_with(
    vllm_server: ServerThread, tiny_model_path: Path, tmp_path: Path
) -> None:
    # The CPU engine keeps a float32 copy of the bf16 lm_head (grpo.inference.vllm_compat.
    # cpu_float32_head); a stale copy after an update would score with the old output layer.
    import torch
    from safetensors.torch import save_file

    original = score(vllm_server, MODEL)
    state = _checkpoint_state(tiny_model_path)
    embedding = state["model.embed_tokens.weight"]  # tied: also the output layer
    generator = torch.Generator().manual_seed(0)
    state["model.embed_tokens.weight"] = (
        torch.randn(embedding.shape, generator=generator) * embedding.float().std() * 3
    ).to(embedding.dtype)
    new_dir = tmp_path / "new-output-layer"
    new_dir.mkdir()
    save_file(state, str(new_dir / "model.safetensors"))

    try:
        with_client(vllm_server, lambda client: client.update_weights(str(new_dir)))
        served = score(vllm_server, MODEL)
    finally:
        with_client(vllm_server, lambda client: client.update_weights(str(tiny_model_path)))

    expected = _reference_logprobs(tiny_model_path, state, PROMPT)
    assert max_abs_diff(served, original) > 0.5  # ~1.1 here
    assert max_abs_diff(served, expected) < 0.1  # ~0.004 here; 1.6 with the old output layer's copy
    assert max_abs_diff(score(vllm_server, MODEL), original) < 1e-3


def test_worker_exports_shared_memory_handles_another_process_can_read(
    vllm_server: ServerThread, shm_records_to_release: list[dict[str, Any]]
) -> None:
    from grpo.inference.weight_handles import rebuild_tensor

    (records,) = vllm_server.collective_rpc("export_weight_handles")
    # Released when the session's server stops: later tests export the same storages again, and a
    # released name is gone for good (tests/inference/conftest.py).
    shm_records_to_release.extend(records)
    qkv = next(r for r in records if "layers.0.self_attn.qkv_proj" in r["name"])
    assert qkv["kind"] == "cpu_shm"
    tensor = rebuild_tensor(qkv)
    # tiny model: 2 q heads + 1 k head + 1 v head, head_dim 64, hidden 128 -> [256, 128]
    assert list(tensor.shape) == [256, 128]
    assert tensor.abs().sum().item() > 0


def test_noisy_norms_change_outputs_until_clean_weights_return(
    vllm_server: ServerThread, tiny_model_path: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    original = score(vllm_server, MODEL)
    state = _checkpoint_state(tiny_model_path)
    noisy = {name: t * 3.0 for name, t in state.items() if "layernorm" in name}
    assert noisy
    save_file(noisy, str(tmp_path / "noisy_norms.safetensors"))

    with_client(
        vllm_server, lambda client: client.apply_noisy_norms(str(tmp_path / "noisy_norms.safetensors"))
    )
    assert max_abs_diff(score(vllm_server, MODEL), original) > 0.01

    with_client(vllm_server, lambda client: client.update_weights(str(tiny_model_path)))
    assert max_abs_diff(score(vllm_server, MODEL), original) < 1e-3


def test_a_published_policy_with_noisy_norms_is_served_with_exactly_those_norms(
    vllm_server: ServerThread,
    tiny_model_path: Path,
    adapter_dirs: tuple[Path, Path],
    shm_records_to_release: list[dict[str, Any]],
    tmp_path: Path,
) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from grpo.inference.weight_handles import rebuild_tensor
    from grpo.trainer.noise import noisy_norms, rms_norm_weights

    # What the trainer publishes under QeRL: the adapter, and noisy copies of the base model's norms.
    folder = tmp_path / "broadcasts" / "step_1"
    shutil.copytree(adapter_dirs[0], folder)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    clean = {name: weight.detach().float() for name, weight in rms_norm_weights(base).items()}
    noisy = noisy_norms(base, sigma=0.1, seed=0)
    save_file(noisy, str(folder / "noisy_norms.safetensors"))
    mark_stable(folder)

    async def load(client: InferenceClient) -> None:
        await PolicyTracker(tmp_path, client, "policy", MODEL).load(1)

    with_client(vllm_server, load)
    (records,) = vllm_server.collective_rpc("export_weight_handles")
    shm_records_to_release.extend(records)
    served = {r["name"]: rebuild_tensor(r) for r in records if r["name"] in noisy}
    assert served.keys() == noisy.keys()
    for name, expected in noisy.items():
        assert torch.equal(served[name].float(), expected.to(served[name].dtype).float()), name
        assert not torch.equal(served[name].float(), clean[name]), name

    with_client(vllm_server, lambda client: client.update_weights(str(tiny_model_path)))


class _FakeEngineClient:
    """Stands in for vLLM's AsyncLLM: only its lifetime matters here."""


def test_stop_lets_go_of_the_engine_client_so_it_is_not_left_for_interpreter_exit() -> None:
    # An AsyncLLM still referenced at interpreter exit runs its __del__ after vLLM's module globals are
    # gone and prints "Exception ignored in AsyncLLM.__del__ ... TypeError" on every clean exit.
    import threading
    import weakref

    import psutil

    from grpo.config.inference import InferenceConfig

    server = ServerThread(InferenceConfig(model=MODEL, port=0), "never-loaded")
    finished = threading.Thread(target=lambda: None)
    finished.start()
    finished.join()
    server._thread = finished  # a server thread whose serve loop has returned
    server._children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    client = _FakeEngineClient()
    server.engine_client = client
    released = weakref.ref(client)
    del client

    server.stop()

    assert server.engine_client is None
    assert released() is None


def test_the_cpu_engine_serves_16_token_kv_blocks(vllm_server: ServerThread) -> None:
    # vLLM declares 32 as the CPU minimum, which shares none of a prompt under 32 tokens; grpo's
    # engine runs its 16-token kernel (an engine whose worker refused the size would not have
    # started). Measured on an engine of its own: 4 completions of a 20-token prompt, prefix-cache
    # hits +48 (three completions found the first block), 0 with 32-token blocks.
    # (This process's Prometheus registry holds the last-started server's metrics, so the shared
    # server's hit counter is not read here.)
    from grpo.inference.server_args import default_cpu_block_size

    # 16, or 32 on a CPU with AMX (its attention kernel takes no less): test_server_args.py pins which
    assert vllm_server.engine_client.vllm_config.cache_config.block_size == default_cpu_block_size()
    request = GenerateRequest(
        prompt_token_ids=PROMPT * 2, params=SamplingParams(temperature=1.0, max_tokens=4, seed=5), n=4,
        model=MODEL, cache_salt="sixteen-token-blocks",
    )  # fmt: skip
    completions = with_client(vllm_server, lambda client: client.generate(request))
    assert len(completions) == 4 and all(0 < len(c.token_ids) <= 4 for c in completions)
