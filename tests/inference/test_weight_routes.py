"""The weight routes load only from the server's weight_dirs, and the collective route exists only in
collective mode."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from grpo.config.inference import InferenceConfig
from grpo.inference import weight_routes
from grpo.inference.server import ServerThread
from grpo.inference.weight_routes import WeightRouteRules

MODEL = "tiny"
PROMPT = [1, 504, 3458, 282, 4195, 314, 260]


def _rules(*folders: Path) -> WeightRouteRules:
    return WeightRouteRules(weight_dirs=tuple(folder.resolve() for folder in folders))


def test_a_path_inside_a_weight_dir_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "run" / "broadcasts" / "step_3").mkdir(parents=True)
    assert _rules(tmp_path / "run").path_refusal(str(tmp_path / "run" / "broadcasts" / "step_3")) is None


def test_a_path_outside_every_weight_dir_is_refused_naming_them_and_the_key(tmp_path: Path) -> None:
    refusal = _rules(tmp_path / "run").path_refusal("/etc")
    assert refusal is not None
    assert "/etc" in refusal and str((tmp_path / "run").resolve()) in refusal and "weight_dirs" in refusal


def test_dot_dot_cannot_climb_out_of_a_weight_dir(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    assert _rules(tmp_path / "run").path_refusal(str(tmp_path / "run" / ".." / "other")) is not None


def test_a_symlink_inside_a_weight_dir_to_a_folder_outside_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "run" / "link").symlink_to(tmp_path / "secret")
    assert _rules(tmp_path / "run").path_refusal(str(tmp_path / "run" / "link")) is not None


def test_a_prefix_of_the_name_is_not_inside(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run-other").mkdir()
    assert _rules(tmp_path / "run").path_refusal(str(tmp_path / "run-other")) is not None


def test_without_weight_dirs_the_server_loads_from_its_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rules = WeightRouteRules.for_config(InferenceConfig(model="m"), "adapter")
    assert rules.weight_dirs == (tmp_path.resolve(),)
    assert rules.path_refusal("outputs/run/broadcasts/step_1") is None
    assert rules.path_refusal(str(tmp_path.parent)) is not None


def test_relative_weight_dirs_are_read_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rules = WeightRouteRules.for_config(InferenceConfig(model="m", weight_dirs=["outputs"]), "adapter")
    assert rules.weight_dirs == ((tmp_path / "outputs").resolve(),)


def test_only_a_collective_mode_server_has_the_receive_route() -> None:
    assert not WeightRouteRules.for_config(InferenceConfig(model="m"), "adapter").collective
    nccl = InferenceConfig(model="m", weight_broadcast_type="nccl", enable_lora=False)
    assert WeightRouteRules.for_config(nccl, "adapter").collective


# ---------------------------------------------------------------------------------------------
# On the session's vLLM server (its weight_dirs: the session's temporary folders)


@pytest.fixture
def outside_dir() -> Iterator[Path]:
    """A folder outside the shared server's weight_dirs (not under pytest's base temp folder)."""
    folder = Path(tempfile.mkdtemp(prefix="grpo-outside-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _post(server: ServerThread, route: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.base_url.removesuffix("/v1") + route, json=body, timeout=120)


def _logprobs(server: ServerThread, model: str) -> list[float]:
    response = httpx.post(
        server.base_url + "/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0},
        timeout=120,
    )
    response.raise_for_status()
    return [0.0 if entry is None else next(iter(entry.values()))["logprob"] for entry in
            response.json()["choices"][0]["prompt_logprobs"]]  # fmt: skip


@pytest.mark.vllm
def test_an_adapter_outside_weight_dirs_is_refused_by_every_loading_route(
    vllm_server: ServerThread, adapter_dirs: tuple[Path, Path], outside_dir: Path
) -> None:
    adapter = shutil.copytree(adapter_dirs[0], outside_dir / "adapter")
    before = _logprobs(vllm_server, MODEL)

    loaded = _post(vllm_server, "/v1/load_lora_adapter", {"lora_name": "rogue", "lora_path": str(adapter)})
    merged = _post(
        vllm_server, weight_routes.MERGE_LORA_ROUTE, {"lora_name": "rogue", "lora_path": str(adapter)}
    )

    for response in (loaded, merged):
        assert response.status_code == 403, response.text
        assert "weight_dirs" in response.text
    models = httpx.get(vllm_server.base_url + "/models", timeout=30).json()["data"]
    assert "rogue" not in {model["id"] for model in models}
    assert _logprobs(vllm_server, MODEL) == before


@pytest.mark.vllm
def test_full_weights_and_noisy_norms_outside_weight_dirs_are_refused(
    vllm_server: ServerThread, tiny_model_path: Path, outside_dir: Path
) -> None:
    from safetensors.torch import load_file, save_file

    state: dict = {}
    for file in sorted(tiny_model_path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    save_file({name: t.clone().zero_() for name, t in state.items()}, str(outside_dir / "model.safetensors"))
    norms = {name: t.clone().zero_() for name, t in state.items() if "norm" in name}
    save_file(norms, str(outside_dir / "norms.safetensors"))
    before = _logprobs(vllm_server, MODEL)

    weights = _post(vllm_server, weight_routes.UPDATE_WEIGHTS_ROUTE, {"path": str(outside_dir)})
    noisy = _post(
        vllm_server, weight_routes.APPLY_NOISY_NORMS_ROUTE, {"path": str(outside_dir / "norms.safetensors")}
    )

    assert (weights.status_code, noisy.status_code) == (403, 403), (weights.text, noisy.text)
    assert _logprobs(vllm_server, MODEL) == before


@pytest.mark.vllm
def test_a_filesystem_mode_server_has_no_collective_route(vllm_server: ServerThread) -> None:
    body = {"host": "10.0.0.9", "port": 29501, "timeout": 5, "version": 1}
    assert _post(vllm_server, weight_routes.RECEIVE_WEIGHTS_ROUTE, body).status_code == 404
