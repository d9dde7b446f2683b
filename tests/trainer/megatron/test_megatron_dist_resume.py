"""Megatron checkpoints on two gloo ranks under torchrun: a run stopped after step 2 and resumed takes
the uninterrupted run's step 3, with data parallel 2 (the distributed optimizer's state sharded over
the ranks), with tensor parallel 2 (a file per tensor-parallel rank) and with pipeline stages 2 (a
file per stage; the last stage's copy of a tied embedding restored with it), and with 2
expert-parallel ranks of a mixture-of-experts model (a file per expert-parallel rank). A
data-parallel checkpoint resumes on one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from megatron_dist_worker import Job, batch, launch, resume_cfg

pytestmark = pytest.mark.slow

COMPARED_METRICS = (
    "loss",
    "mismatch_kl",
    "entropy",
    "masked",
    "tokens",
    "grad_norm",
    "grad_norm_before_clip",
    "lr",
    "skipped_steps",
)


def _result(out_dir: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from safetensors.torch import load_file

    metrics = json.loads((out_dir / f"{name}_metrics.json").read_text())
    return load_file(str(out_dir / f"{name}.safetensors")), metrics


def _assert_resumed_equals_whole(out_dir: Path) -> None:
    from safetensors.torch import load_file

    whole, whole_metrics = _result(out_dir, "whole")
    resumed, resumed_metrics = _result(out_dir, "resumed")
    for key in COMPARED_METRICS:
        assert resumed_metrics[key] == whole_metrics[key], key
    assert set(resumed) == set(whole)
    for name, tensor in whole.items():
        assert torch.equal(resumed[name], tensor), name
    whole_logprobs, resumed_logprobs = (
        load_file(str(out_dir / f"{run}_logprobs.safetensors")) for run in ("whole", "resumed")
    )
    assert set(resumed_logprobs) == set(whole_logprobs)
    for row, lp in whole_logprobs.items():
        assert torch.equal(resumed_logprobs[row], lp), f"logprobs of row {row}"


@pytest.fixture(scope="module")
def two_rank_runs(
    tiny_llama_tp2_path: Path,
    tiny_model_path: Path,
    qwen3_moe_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    """OUT_DIR of the worker's resume scenario on 2 ranks for each layout, all in one torchrun (its
    start-up costs more here than the runs): data parallel and tensor parallel on the tiny Llama,
    pipeline stages on the tiny model (tied embeddings), expert parallel on the tiny Qwen3-MoE."""
    root = tmp_path_factory.mktemp("resume")
    jobs = {
        "data_parallel_run": Job(tiny_llama_tp2_path, root / "dp", tp=1, scenario="resume"),
        "tensor_parallel_run": Job(tiny_llama_tp2_path, root / "tp", tp=2, scenario="resume"),
        "pipeline_tied_run": Job(tiny_model_path, root / "pp", tp=1, pp=2, scenario="resume"),
        "expert_parallel_run": Job(qwen3_moe_path, root / "ep", tp=1, scenario="resume", ep=2),
    }
    launch(list(jobs.values()), num_ranks=2)
    return {name: job.out_dir for name, job in jobs.items()}


@pytest.mark.parametrize(("layout", "tp"), [("data_parallel_run", 1), ("tensor_parallel_run", 2)])
def test_two_ranks_resumed_take_the_uninterrupted_runs_third_step(
    layout: str, tp: int, two_rank_runs: dict[str, Path]
) -> None:
    from grpo.trainer.checkpoint import checkpoint_dir

    out_dir = two_rank_runs[layout]
    _assert_resumed_equals_whole(out_dir)
    folder = checkpoint_dir(out_dir / "split", 2)
    model_files = sorted(p.name for p in folder.glob("model_*.safetensors"))
    assert model_files == [f"model_tp{t}_pp0.safetensors" for t in range(tp)]
    if tp == 1:  # data parallel 2: the optimizer state is gathered from both ranks' shards, once
        assert sorted(p.name for p in folder.glob("param_state_*.safetensors")) == [
            "param_state_tp0_pp0.safetensors"
        ]
    assert sorted(p.name for p in folder.glob("rng_rank*.json")) == ["rng_rank0.json", "rng_rank1.json"]


def test_two_expert_parallel_ranks_resumed_take_the_uninterrupted_runs_third_step(
    two_rank_runs: dict[str, Path],
) -> None:
    """Each expert-parallel rank saves its own experts (and, with the distributed optimizer, their
    main weights and moments: megatron-core keeps the experts' optimizer apart, over the
    expert-data-parallel group) beside a copy of the rest; a resume restores each rank's own."""
    from safetensors.torch import load_file

    from grpo.trainer.checkpoint import checkpoint_dir

    out_dir = two_rank_runs["expert_parallel_run"]
    _assert_resumed_equals_whole(out_dir)
    folder = checkpoint_dir(out_dir / "split", 2)
    names = ["model_tp0_pp0_ep0.safetensors", "model_tp0_pp0_ep1.safetensors"]
    assert sorted(p.name for p in folder.glob("model_*.safetensors")) == names
    assert sorted(p.name for p in folder.glob("param_state_*.safetensors")) == [
        "param_state_tp0_pp0_ep0.safetensors",
        "param_state_tp0_pp0_ep1.safetensors",
    ]
    first, second = (load_file(str(folder / name)) for name in names)
    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight" not in first
    assert not torch.equal(first[expert], second[expert]), "each rank holds its own experts"


def test_two_pipeline_stages_resumed_take_the_uninterrupted_runs_third_step_with_a_tied_embedding(
    two_rank_runs: dict[str, Path],
) -> None:
    """The tiny model ties its embeddings: the first stage holds the embedding, the last stage a copy
    as its output layer (with its own optimizer state), each in its own stage's file. The copy must
    come back from the checkpoint (the third step's loss reads it) and take the same update as the
    embedding (the logprobs scored after the step read it)."""
    from safetensors.torch import load_file

    from grpo.trainer.checkpoint import checkpoint_dir

    out_dir = two_rank_runs["pipeline_tied_run"]
    _assert_resumed_equals_whole(out_dir)
    whole, _ = _result(out_dir, "whole")
    assert "lm_head.weight" not in whole, "the tiny model ties its embeddings"

    folder = checkpoint_dir(out_dir / "split", 2)
    assert sorted(p.name for p in folder.glob("model_*.safetensors")) == [
        "model_tp0_pp0.safetensors",
        "model_tp0_pp1.safetensors",
    ]
    assert sorted(p.name for p in folder.glob("rng_rank*.json")) == ["rng_rank0.json", "rng_rank1.json"]
    first, last = (load_file(str(folder / f"model_tp0_pp{p}.safetensors")) for p in (0, 1))
    assert "output_layer.weight" not in first and "embedding.word_embeddings.weight" not in last
    assert "decoder.final_layernorm.weight" in last and "decoder.final_layernorm.weight" not in first
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])


@pytest.mark.usefixtures("float32_compute")
def test_a_data_parallel_checkpoint_resumes_on_one_rank(
    two_rank_runs: dict[str, Path], tiny_llama_tp2_path: Path
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    out_dir = two_rank_runs["data_parallel_run"]
    split_dir = out_dir / "split"
    trainer = MegatronTrainer(
        resume_cfg(str(tiny_llama_tp2_path), tp=1, pp=1, world_size=1, run_dir=split_dir), split_dir
    )
    try:
        assert trainer.maybe_resume() == 2
        metrics = trainer.train_step(batch(2))
        weights = trainer.hf_state_dict()
    finally:
        trainer.close()
    whole, whole_metrics = _result(out_dir, "whole")
    # One rank sums the step's gradient in another order than two: float32 rounding apart.
    for key in ("loss", "mismatch_kl", "entropy", "grad_norm", "grad_norm_before_clip"):
        assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-4), key
    assert weights is not None
    for name, tensor in whole.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-6, rtol=0, msg=name)
