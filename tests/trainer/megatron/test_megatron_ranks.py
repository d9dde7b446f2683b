"""Two gloo ranks under torchrun (tensor parallel 2; data parallel 2) give the logprobs and the first
update of one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo[megatron])")

from megatron_dist_worker import launch


def _launch(model_path: Path, out_dir: Path, num_ranks: int, tp: int) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    launch(model_path, out_dir, num_ranks, tp)
    return load_file(str(out_dir / "result.safetensors")), json.loads((out_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def one_rank(tiny_llama_tp2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return _launch(tiny_llama_tp2_path, tmp_path_factory.mktemp("one") / "out", num_ranks=1, tp=1)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "what"), [(2, "tensor parallel"), (1, "data parallel")])
def test_two_ranks_give_the_logprobs_and_first_update_of_one(
    tp: int, what: str, one_rank: tuple[dict, dict], tiny_llama_tp2_path: Path, tmp_path: Path
) -> None:
    single, single_metrics = one_rank
    double, double_metrics = _launch(tiny_llama_tp2_path, tmp_path / "out", num_ranks=2, tp=tp)
    assert set(double) == set(single)
    for name, tensor in single.items():
        if name.startswith("logprobs."):
            torch.testing.assert_close(double[name], tensor, atol=1e-5, rtol=0, msg=f"{what}: {name}")
        else:
            torch.testing.assert_close(double[name], tensor, atol=1e-6, rtol=0, msg=f"{what}: {name}")
    for key in ("loss", "kl", "entropy", "tokens", "grad_norm"):
        assert double_metrics[key] == pytest.approx(single_metrics[key], rel=1e-4), key
