"""One rank of the Megatron multi-rank tests (run by torchrun from the tests through `launch`; not a test module).

Usage: torchrun --standalone --nproc_per_node N megatron_dist_worker.py JOBS
JOBS is a JSON list of [MODEL_PATH, OUT_DIR, TP, PP, SCENARIO, EP, OPTIONS], run one after another
on the same ranks: one start-up (torchrun, imports, process group) serves several layouts, each job
building its own MegatronTrainer (float32, tensor parallel TP, pipeline stages PP, data parallel
N / (TP x PP), expert parallel EP; Megatron's groups are remade when the sizes change, as in a
process that builds a second trainer). Rank 0 shares `batch(step)` (on a mixture-of-experts model,
its tokens drawn from the model's vocabulary and its inference logprobs near uniform). OPTIONS:
`replay` (routing_replay on, every row carrying random routing), `uneven` (three rows: one of two
data-parallel ranks trains a loss-free padding row).
- `step` (the default): every rank scores its rows, trains one step and scores them again; rank 0
  writes both logprobs, the metrics and the whole HF-named weights after the step to OUT_DIR (the
  logprobs after it also read the last pipeline stage's copy of a tied embedding); on a
  mixture-of-experts model it also publishes the policy (OUT_DIR/run/broadcasts/step_1).
- `resume`: an uninterrupted run trains 3 steps (run dir OUT_DIR/whole); a split run trains 2,
  checkpoints and stops (OUT_DIR/split), and a new trainer resumes it and trains the third. Rank 0
  writes the weights and metrics after each run's third step (whole.*, resumed.*) and the logprobs
  of that step's rows scored after it (*_logprobs.safetensors: they read the last pipeline stage's
  copy of a tied embedding, which the weights leave out).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

from torchrun_launch import run_under_torchrun
from trainer_batches import make_row

from grpo.transport.batches.batch import TrainingBatch

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.megatron.trainer import MegatronTrainer


MOE_VOCAB = 512
"""The tiny MoE models' vocabulary (tests/trainer/model_families.py)."""


def batch(step: int = 0, moe: bool = False, options: tuple[str, ...] = ()) -> TrainingBatch:
    seed = 10 * step
    vocab = MOE_VOCAB if moe else 1000
    rows = [
        make_row([(6, 10), (4, 12)], [1.0, -1.0], seed=seed + 1, temperature=0.7, vocab=vocab),
        make_row([(9, 7)], [0.5], seed=seed + 2, temperature=1.3, vocab=vocab),
        make_row([(5, 9), (3, 6)], [-0.5, 2.0], seed=seed + 3, vocab=vocab),
        make_row([(4, 8)], [1.5], seed=seed + 4, vocab=vocab),
    ]
    if "uneven" in options:
        rows = rows[:3]
    # Near the model's own logprobs, so the ratios are not all clipped (the tiny Llama's vocabulary
    # is 49152; 1000 token ids of it are drawn).
    inference_logprob = -6.3 if moe else -10.5
    for row in rows:
        row.inference_logprobs = np.where(row.loss_mask, inference_logprob, 0.0).astype(np.float32)
    if "replay" in options:
        with_routing(rows, seed=step)
    return TrainingBatch(step=step, rows=rows)


def with_routing(
    rows: list[Any], seed: int, num_layers: int = 2, num_experts: int = 4, top_k: int = 2
) -> None:
    """Random distinct experts for every token and layer of `rows` (most differ from the model's own
    choice), every fifth token unrecorded (its router chooses)."""
    from grpo.transport.batches.batch import no_routing

    rng = np.random.default_rng(100 + seed)
    for row in rows:
        num_tokens = len(row.input_ids)
        choice = [rng.permutation(num_experts)[:top_k] for _ in range(num_tokens * num_layers)]
        routing = np.asarray(choice, dtype=np.uint8).reshape(num_tokens, num_layers, top_k)
        routing[::5] = no_routing(np.dtype(np.uint8))
        row.routed_experts = routing


@dataclass(frozen=True)
class Job:
    """One scenario of this worker on one layout: the model, its OUT_DIR, tensor parallel size,
    pipeline stages, expert parallel size and OPTIONS."""

    model_path: Path
    out_dir: Path
    tp: int
    pp: int = 1
    scenario: str = "step"
    ep: int = 1
    options: tuple[str, ...] = ()


def launch(jobs: list[Job], num_ranks: int) -> None:
    """Run `jobs` one after another on the same `num_ranks` gloo ranks of one torchrun (from a test);
    fails with its stderr."""
    for job in jobs:
        job.out_dir.mkdir(parents=True, exist_ok=True)
    spec = [[str(j.model_path), str(j.out_dir), j.tp, j.pp, j.scenario, j.ep, list(j.options)] for j in jobs]
    run_under_torchrun(__file__, [json.dumps(spec)], num_ranks, timeout_s=300 + 300 * len(jobs))


def worker_cfg(
    model_path: str, tp: int, pp: int, world_size: int, ep: int = 1, **extra: Any
) -> TrainerConfig:
    from grpo.config.trainer import TrainerConfig

    return TrainerConfig(
        model=model_path,
        backend="megatron",
        lora=False,
        gpus=world_size,
        megatron={
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "expert_model_parallel_size": ep,
        },
        learning_rate=1e-3,
        adam_epsilon=1e-5,  # see test_megatron_step: keeps Adam's first update smooth in the gradient
        max_grad_norm=0.5,
        per_device_train_batch_size=1,
        logprob_chunk_size=16,
        **extra,
    )


@dataclass(frozen=True)
class Layout:
    """A worker run: the model and the parallel sizes its ranks were launched with."""

    model_path: str
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    options: tuple[str, ...] = ()

    @property
    def moe(self) -> bool:
        from transformers import AutoConfig

        return bool(getattr(AutoConfig.from_pretrained(self.model_path), "num_experts", None))

    def batch(self, step: int) -> TrainingBatch:
        return batch(step, self.moe, self.options)

    def cfg(self, **extra: Any) -> TrainerConfig:
        replay = {"routing_replay": True} if "replay" in self.options else {}
        return worker_cfg(self.model_path, self.tp, self.pp, self.world_size, self.ep, **replay, **extra)


def resume_cfg(
    model_path: str, tp: int, pp: int, world_size: int, run_dir: Path, ep: int = 1
) -> TrainerConfig:
    """The resume scenario's config (also used by the test to resume on one rank)."""
    return worker_cfg(
        model_path,
        tp,
        pp,
        world_size,
        ep,
        output_dir=str(run_dir),
        max_steps=3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        ckpt={"interval": 2, "resume_step": -1},
    )


def train(trainer: MegatronTrainer, layout: Layout, steps: range) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for step in steps:
        shared = trainer.share_batch(layout.batch(step) if trainer.is_main else None)
        assert shared is not None
        metrics = trainer.train_step(shared)
    return metrics


def write_result(
    trainer: MegatronTrainer, layout: Layout, metrics: dict[str, float], out_dir: Path, name: str
) -> None:
    """The whole HF-named weights (float32), the metrics and the logprobs of the last batch's rows
    scored now, written by rank 0 (collective)."""
    import torch
    from safetensors.torch import save_file

    weights = trainer.hf_state_dict()
    logprobs = trainer.score(layout.batch(trainer.num_steps_done - 1).rows)
    if trainer.is_main:
        assert weights is not None
        save_file(
            {k: v.float().contiguous() for k, v in weights.items()}, str(out_dir / f"{name}.safetensors")
        )
        save_file(
            {str(i): torch.from_numpy(lp) for i, lp in enumerate(logprobs)},
            str(out_dir / f"{name}_logprobs.safetensors"),
        )
        (out_dir / f"{name}_metrics.json").write_text(json.dumps(metrics))


def resume_scenario(layout: Layout, out_dir: Path) -> None:
    import torch

    from grpo.trainer.megatron.trainer import MegatronTrainer

    def cfg(run_dir: Path) -> TrainerConfig:
        return resume_cfg(layout.model_path, layout.tp, layout.pp, layout.world_size, run_dir, layout.ep)

    whole = MegatronTrainer(cfg(out_dir / "whole"), out_dir / "whole")
    write_result(whole, layout, train(whole, layout, range(3)), out_dir, "whole")
    whole.close()
    first = MegatronTrainer(cfg(out_dir / "split"), out_dir / "split")
    train(first, layout, range(2))
    first.save_checkpoint()
    first.close()
    torch.manual_seed(1234)  # the checkpoint's RNG state must win over whatever the process holds
    resumed = MegatronTrainer(cfg(out_dir / "split"), out_dir / "split")
    assert resumed.maybe_resume() == 2
    write_result(resumed, layout, train(resumed, layout, range(2, 3)), out_dir, "resumed")
    resumed.close()


def step_scenario(layout: Layout, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from grpo.trainer.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(layout.cfg(), out_dir / "run")
    shared = trainer.share_batch(layout.batch(0) if trainer.is_main else None)
    assert shared is not None
    logprobs = trainer.score(shared.rows)
    metrics = trainer.train_step(shared)
    updated_logprobs = trainer.score(shared.rows)
    weights = trainer.hf_state_dict()
    if layout.moe:
        trainer.publish(1)
    if trainer.is_main:
        assert weights is not None
        tensors = {f"weight.{k}": v.float().contiguous() for k, v in weights.items()}
        tensors.update({f"logprobs.{i}": torch.from_numpy(lp) for i, lp in enumerate(logprobs)})
        tensors.update(
            {f"logprobs.updated.{i}": torch.from_numpy(lp) for i, lp in enumerate(updated_logprobs)}
        )
        save_file(tensors, str(out_dir / "result.safetensors"))
        (out_dir / "metrics.json").write_text(json.dumps(metrics))
    trainer.close()


def read_step_result(out_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What `step_scenario`'s rank 0 wrote to OUT_DIR: the tensors (weights, logprobs before and
    after the step) and the step's metrics."""
    from safetensors.torch import load_file

    return load_file(str(out_dir / "result.safetensors")), json.loads((out_dir / "metrics.json").read_text())


def main(jobs: list[list[Any]]) -> None:
    import os

    import torch

    import grpo.trainer.device as device_module
    import grpo.trainer.hf.model as model_module

    def float32(device: torch.device) -> torch.dtype:
        return torch.float32

    model_module.choose_dtype = float32  # type: ignore[assignment]
    device_module.choose_dtype = float32  # type: ignore[assignment]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    scenarios = {"step": step_scenario, "resume": resume_scenario}
    for model_path, out_dir, tp, pp, scenario, ep, options in jobs:
        assert scenario in scenarios, scenario
        layout = Layout(model_path, tp, pp, world_size, ep, tuple(options))
        scenarios[scenario](layout, Path(out_dir))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
