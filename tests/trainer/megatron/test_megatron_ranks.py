"""Gloo ranks under torchrun (tensor parallel 2; pipeline stages 2; data parallel 2; and four ranks
combining pipeline stages with either) give the logprobs and the first update of one rank.

Each world size is one torchrun that takes every layout of that size in turn (a start-up of torchrun
and megatron-core costs more here than a tiny model's step): the tests read their layout's result."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from megatron_dist_worker import Job, launch, read_step_result

# (model, num_ranks, tp, pp) of every run: "llama" the tiny Llama whose heads split two ways, "tied"
# the tiny model (tied embeddings), "qwen2" the tiny Qwen2 (q/k/v biases).
LAYOUTS = (
    ("llama", 1, 1, 1),
    ("tied", 1, 1, 1),
    ("qwen2", 1, 1, 1),
    ("llama", 2, 2, 1),
    ("llama", 2, 1, 2),
    ("llama", 2, 1, 1),
    ("tied", 2, 1, 2),
    ("qwen2", 2, 2, 1),
    ("qwen2", 2, 1, 2),
    ("llama", 4, 2, 2),
    ("tied", 4, 1, 2),
)


Layout = tuple[str, int, int, int]
Result = tuple[dict[str, torch.Tensor], dict]


@pytest.fixture(scope="module")
def result(
    tiny_llama_tp2_path: Path,
    tiny_model_path: Path,
    tiny_qwen2_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[Layout], Result]:
    """A layout's logprobs, update and metrics; the first request for a world size runs all its
    layouts in one torchrun."""
    models = {"llama": tiny_llama_tp2_path, "tied": tiny_model_path, "qwen2": tiny_qwen2_path}
    root = tmp_path_factory.mktemp("ranks")
    out_dirs = {layout: root / "-".join(map(str, layout)) for layout in LAYOUTS}
    launched: set[int] = set()

    def get(layout: Layout) -> Result:
        num_ranks = layout[1]
        if num_ranks not in launched:
            launched.add(num_ranks)
            jobs = [
                Job(models[m], out_dirs[(m, n, tp, pp)], tp, pp) for m, n, tp, pp in LAYOUTS if n == num_ranks
            ]
            launch(jobs, num_ranks)
        return read_step_result(out_dirs[layout])

    return get


def _assert_same_run(double: tuple[dict, dict], single: tuple[dict, dict], what: str) -> None:
    (tensors, metrics), (single_tensors, single_metrics) = double, single
    assert set(tensors) == set(single_tensors)
    for name, tensor in single_tensors.items():
        atol = 1e-5 if name.startswith("logprobs.") else 1e-6
        torch.testing.assert_close(tensors[name], tensor, atol=atol, rtol=0, msg=f"{what}: {name}")
    for key in ("loss", "mismatch_kl", "entropy", "tokens", "grad_norm", "grad_norm_before_clip"):
        assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-4), key


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
    result: Callable[[Layout], Result],
) -> None:
    _assert_same_run(result(("llama", num_ranks, tp, pp)), result(("llama", 1, 1, 1)), what)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("num_ranks", "what"), [(2, "pipeline stages"), (4, "data parallel x pipeline stages")]
)
def test_pipeline_stages_sum_the_gradients_of_a_tied_embedding(
    num_ranks: int, what: str, result: Callable[[Layout], Result]
) -> None:
    """The first stage's embedding and the last stage's output layer are one tied weight: its update
    sums both gradients, on both copies (the logprobs after the step read the last stage's)."""
    several, single = result(("tied", num_ranks, 1, 2)), result(("tied", 1, 1, 1))
    assert "weight.lm_head.weight" not in single[0], "the tiny model ties its embeddings"
    _assert_same_run(several, single, f"{what}, tied embeddings")


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "what"), [(2, 1, "tensor parallel"), (1, 2, "pipeline stages")])
def test_qwen2_biases_split_over_ranks_give_the_logprobs_and_first_update_of_one(
    tp: int, pp: int, what: str, result: Callable[[Layout], Result]
) -> None:
    single = result(("qwen2", 1, 1, 1))
    assert single[1]["masked"] < 1, "the step must train something"
    _assert_same_run(result(("qwen2", 2, tp, pp)), single, what)
