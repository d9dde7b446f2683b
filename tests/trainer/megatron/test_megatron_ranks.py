"""Gloo ranks under torchrun (tensor parallel 2; pipeline stages 2; data parallel 2; and four ranks
combining pipeline stages with either) give the logprobs and the first update of one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from megatron_dist_worker import launch


def _launch(
    model_path: Path, out_dir: Path, num_ranks: int, tp: int, pp: int = 1
) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    launch(model_path, out_dir, num_ranks, tp, pp)
    return load_file(str(out_dir / "result.safetensors")), json.loads((out_dir / "metrics.json").read_text())


def _assert_same_run(double: tuple[dict, dict], single: tuple[dict, dict], what: str) -> None:
    (tensors, metrics), (single_tensors, single_metrics) = double, single
    assert set(tensors) == set(single_tensors)
    for name, tensor in single_tensors.items():
        atol = 1e-5 if name.startswith("logprobs.") else 1e-6
        torch.testing.assert_close(tensors[name], tensor, atol=atol, rtol=0, msg=f"{what}: {name}")
    for key in ("loss", "kl", "entropy", "tokens", "grad_norm", "grad_norm_before_clip"):
        assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-4), key


@pytest.fixture(scope="module")
def one_rank(tiny_llama_tp2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    return _launch(tiny_llama_tp2_path, tmp_path_factory.mktemp("one") / "out", num_ranks=1, tp=1)


@pytest.fixture(scope="module")
def one_rank_tied(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    single = _launch(tiny_model_path, tmp_path_factory.mktemp("one-tied") / "out", num_ranks=1, tp=1)
    assert "weight.lm_head.weight" not in single[0], "the tiny model ties its embeddings"
    return single


@pytest.fixture(scope="module")
def one_rank_qwen2(tiny_qwen2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    single = _launch(tiny_qwen2_path, tmp_path_factory.mktemp("one-qwen2") / "out", num_ranks=1, tp=1)
    assert single[1]["masked"] < 1, "the step must train something"
    return single


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_ranks", "tp", "pp", "what"),
    [
        (2, 2, 1, "tensor parallel"),
        (2, 1, 2, "pipeline stages"),
        (2, 1, 1, "data parallel"),
        (4, 2, 2, "tensor parallel x pipeline stages"),
    ],
)
def test_several_ranks_give_the_logprobs_and_first_update_of_one(
    num_ranks: int,
    tp: int,
    pp: int,
    what: str,
    one_rank: tuple[dict, dict],
    tiny_llama_tp2_path: Path,
    tmp_path: Path,
) -> None:
    several = _launch(tiny_llama_tp2_path, tmp_path / "out", num_ranks=num_ranks, tp=tp, pp=pp)
    _assert_same_run(several, one_rank, what)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_ranks", "what"), [(2, "pipeline stages"), (4, "data parallel x pipeline stages")]
)
def test_pipeline_stages_sum_the_gradients_of_a_tied_embedding(
    num_ranks: int, what: str, one_rank_tied: tuple[dict, dict], tiny_model_path: Path, tmp_path: Path
) -> None:
    """The first stage's embedding and the last stage's output layer are one tied weight: its update
    sums both gradients, on both copies (the logprobs after the step read the last stage's)."""
    several = _launch(tiny_model_path, tmp_path / "out", num_ranks=num_ranks, tp=1, pp=2)
    _assert_same_run(several, one_rank_tied, f"{what}, tied embeddings")


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "what"), [(2, 1, "tensor parallel"), (1, 2, "pipeline stages")])
def test_qwen2_biases_split_over_ranks_give_the_logprobs_and_first_update_of_one(
    tp: int, pp: int, what: str, one_rank_qwen2: tuple[dict, dict], tiny_qwen2_path: Path, tmp_path: Path
) -> None:
    several = _launch(tiny_qwen2_path, tmp_path / "out", num_ranks=2, tp=tp, pp=pp)
    _assert_same_run(several, one_rank_qwen2, what)
