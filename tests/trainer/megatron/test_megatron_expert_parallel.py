"""Expert parallelism on gloo ranks under torchrun: the tiny Qwen3-MoE (4 experts, top-2) with its
experts split over 2 ranks (expert_model_parallel_size 2, the all-to-all token dispatcher; the two
ranks are data-parallel ranks for everything else) gives the logprobs, the first full update (every
weight, gathered) and the metrics of one rank, float32: with the router's own routing, and with
replayed routing on a batch of three rows (one rank trains a loss-free padding row: both ranks must
still make the same decoder calls). The policy it publishes is the whole model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from megatron_dist_worker import Job, batch, launch, read_step_result
from trainer_batches import reference_logprobs

pytestmark = pytest.mark.slow

REPLAY_UNEVEN = ("replay", "uneven")


def _launch_both(model_path: Path, root: Path, num_ranks: int, ep: int) -> dict[str, Path]:
    """OUT_DIR of the worker's step with the routers' own routing (`plain`) and with replayed
    routing on uneven rows (`replayed`), both in one torchrun of `num_ranks` ranks."""
    jobs = {
        "plain": Job(model_path, root / "plain", tp=1, ep=ep),
        "replayed": Job(model_path, root / "replayed", tp=1, ep=ep, options=REPLAY_UNEVEN),
    }
    launch(list(jobs.values()), num_ranks)
    return {name: job.out_dir for name, job in jobs.items()}


@pytest.fixture(scope="module")
def one_rank_runs(qwen3_moe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _launch_both(qwen3_moe_path, tmp_path_factory.mktemp("one"), num_ranks=1, ep=1)


@pytest.fixture(scope="module")
def two_expert_rank_runs(qwen3_moe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _launch_both(qwen3_moe_path, tmp_path_factory.mktemp("ep2"), num_ranks=2, ep=2)


def _assert_same_run(several: tuple[dict, dict], single: tuple[dict, dict], original: dict) -> None:
    (tensors, metrics), (single_tensors, single_metrics) = several, single
    assert set(tensors) == set(single_tensors)
    for name, tensor in single_tensors.items():
        atol = 1e-5 if name.startswith("logprobs.") else 1e-6
        torch.testing.assert_close(tensors[name], tensor, atol=atol, rtol=0, msg=name)
    # Every expert of both ranks trained and came back under its own number.
    experts = [name for name in original if ".mlp.experts." in name]
    assert len(experts) == 2 * 4 * 3, "2 layers x 4 experts x gate, up, down"
    for name in experts:
        assert not torch.equal(tensors[f"weight.{name}"], original[name]), f"{name} did not move"
    keys = ("loss", "mismatch_kl", "entropy", "tokens", "grad_norm", "grad_norm_before_clip", "masked")
    for key in keys:
        assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-7), key
    assert single_metrics["masked"] < 1, "the step must train something"


def test_two_expert_parallel_ranks_give_the_logprobs_and_first_update_of_one(
    two_expert_rank_runs: dict[str, Path], one_rank_runs: dict[str, Path], qwen3_moe_path: Path
) -> None:
    from grpo.trainer.megatron.model import read_hf_weights

    several, single = (
        read_step_result(two_expert_rank_runs["plain"]),
        read_step_result(one_rank_runs["plain"]),
    )
    _assert_same_run(several, single, read_hf_weights(qwen3_moe_path))


def test_replayed_routing_on_expert_parallel_ranks_with_uneven_rows_gives_one_ranks_step(
    two_expert_rank_runs: dict[str, Path], one_rank_runs: dict[str, Path], qwen3_moe_path: Path
) -> None:
    from grpo.trainer.megatron.model import read_hf_weights

    several, single = (
        read_step_result(two_expert_rank_runs["replayed"]),
        read_step_result(one_rank_runs["replayed"]),
    )
    _assert_same_run(several, single, read_hf_weights(qwen3_moe_path))
    single_fraction = single[1]["routing_mismatch_fraction"]
    assert single_fraction > 0.3, "the replayed routing differs from the routers' own"
    assert several[1]["routing_mismatch_fraction"] == pytest.approx(single_fraction, abs=1e-9)


def test_the_policy_published_by_expert_parallel_ranks_is_whole_and_gives_their_logprobs_in_hf(
    two_expert_rank_runs: dict[str, Path], qwen3_moe_path: Path
) -> None:
    from grpo.trainer.megatron.model import read_hf_weights
    from grpo.transport.weights.filesystem import broadcast_dir

    out_dir = two_expert_rank_runs["plain"]
    folder = broadcast_dir(out_dir / "run", 1)
    assert set(read_hf_weights(folder)) == set(read_hf_weights(qwen3_moe_path))
    trained, _ = read_step_result(out_dir)
    rows = batch(0, moe=True).rows
    for i, lp in enumerate(reference_logprobs(folder, rows)):
        before = trained[f"logprobs.{i}"].numpy()
        after = trained[f"logprobs.updated.{i}"].numpy()
        assert np.abs(after - before).max() > 1e-3, "the step must change the logprobs"
        np.testing.assert_allclose(lp, after, atol=2e-5)
