"""Backend megatron on a mixture-of-experts model: a tiny Qwen3-MoE (per-head q/k norms, 4 experts
top-2 in every layer) converts into megatron-core's MoE layers (local spec, SequentialMLP experts,
no load-balancing loss) and computes what the HF backend computes: logprobs, and one full update."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

from model_families import VOCAB
from trainer_batches import make_row, on_policy_batch, reference_logprobs

from grpo.config.trainer import TrainerConfig
from grpo.trainer.megatron.convert import DecoderShape, hf_to_megatron, megatron_to_hf
from grpo.trainer.megatron.model import read_hf_weights
from grpo.utils.device import cuda_present

# The trainer takes CUDA when there is one, where float32 agrees with the HF backend within a few
# 1e-6 (2.9e-6 measured on an H100) rather than the CPU's 2e-6: the GPU's kernels sum in other orders.
# float32 logprobs near -10 are a few ulps apart (one is ~1e-6 there) with the CPU's GEMM kernels:
# 1.5e-6 on AVX2, 2.9e-6 with AVX-512's.
LOGPROB_ATOL = 1e-5 if cuda_present() else 5e-6


def _rows() -> list[object]:
    return [
        make_row([(6, 10), (4, 12)], [1.0, -1.0], seed=1, temperature=0.7, vocab=VOCAB),
        make_row([(9, 7)], [0.5], seed=2, temperature=1.3, vocab=VOCAB),
        make_row([(5, 9), (3, 6)], [-0.5, 2.0], seed=3, vocab=VOCAB),
    ]


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) in the
    checkpoint's per-expert names."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for j, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                out[name.replace("gate_up_proj", f"{j}.gate_proj.weight")] = gate
                out[name.replace("gate_up_proj", f"{j}.up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            for j, down in enumerate(tensor):
                out[name.replace("down_proj", f"{j}.down_proj.weight")] = down
        else:
            out[name] = tensor
    return out


def test_qwen3_moe_converts_to_megatron_and_back_exactly(qwen3_moe_path: Path) -> None:
    from transformers import AutoConfig

    hf = read_hf_weights(qwen3_moe_path)
    shape = DecoderShape.from_hf_config(AutoConfig.from_pretrained(qwen3_moe_path))
    assert shape.num_experts == 4 and shape.qk_norm
    whole = hf_to_megatron(hf, shape)
    assert torch.equal(whole["decoder.layers.1.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
    assert torch.equal(
        whole["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"],
        hf["model.layers.0.mlp.experts.3.down_proj.weight"],
    )
    back = megatron_to_hf(whole, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.usefixtures("float32_compute")
def test_megatron_moe_logprobs_equal_the_hf_models(
    qwen3_moe_path: Path, megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    rows = _rows()
    trainer = MegatronTrainer(megatron_cfg(model=str(qwen3_moe_path)), tmp_path)
    got = trainer.score(rows)
    trainer.close()
    for lp, ref in zip(got, reference_logprobs(qwen3_moe_path, rows), strict=True):
        np.testing.assert_allclose(lp, ref, atol=LOGPROB_ATOL)


@pytest.mark.usefixtures("float32_compute")
def test_one_megatron_moe_update_equals_the_hf_backends_full_update(
    qwen3_moe_path: Path,
    make_cfg: Callable[..., TrainerConfig],
    megatron_cfg: Callable[..., TrainerConfig],
    tmp_path: Path,
) -> None:
    from grpo.trainer.hf.trainer import Trainer
    from grpo.trainer.megatron.trainer import MegatronTrainer

    common = {  # adam_epsilon: see test_megatron_step
        "model": str(qwen3_moe_path),
        "learning_rate": 1e-3,
        "max_grad_norm": 0.5,
        "adam_epsilon": 1e-5,
    }
    hf = Trainer(make_cfg(lora=False, optimizer="adamw", **common), tmp_path / "hf")
    batch = on_policy_batch(hf, 0, _rows())
    for row in batch.rows:  # off-policy a little, so the ratios are not trivial
        row.inference_logprobs = np.where(row.loss_mask, row.inference_logprobs - 0.05, 0).astype(np.float32)
    megatron = MegatronTrainer(megatron_cfg(**common), tmp_path / "megatron")
    before = {name: tensor.clone() for name, tensor in (megatron.hf_state_dict() or {}).items()}
    hf_metrics = hf.train_step(copy.deepcopy(batch))
    megatron_metrics = megatron.train_step(copy.deepcopy(batch))
    for key in ("loss", "entropy", "tokens", "grad_norm", "grad_norm_before_clip"):
        assert megatron_metrics[key] == pytest.approx(hf_metrics[key], rel=1e-4, abs=1e-6), key
    after = megatron.hf_state_dict()
    assert after is not None
    hf_after = _per_expert(hf.policy.causal_lm.state_dict())
    moved = [name for name, tensor in after.items() if not torch.equal(tensor, before[name])]
    assert "model.layers.0.mlp.gate.weight" in moved and "model.layers.1.self_attn.q_norm.weight" in moved
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, hf_after[name], atol=1e-6, rtol=0, msg=name)
    hf.close()
    megatron.close()


def _with_routing(rows: list[object], seed: int = 0) -> list[object]:
    """`rows` with random distinct experts per token and layer (most differ from the model's own
    top-2 of 4), a few tokens left unrecorded (the router then chooses itself)."""
    from grpo.transport.batches.batch import no_routing

    rng = np.random.default_rng(seed)
    for row in rows:
        num_tokens = len(row.input_ids)
        choice = [rng.permutation(4)[:2] for _ in range(num_tokens * 2)]
        routing = np.asarray(choice, dtype=np.uint8).reshape(num_tokens, 2, 2)
        routing[::5] = no_routing(np.dtype(np.uint8))
        row.routed_experts = routing
    return rows


@pytest.mark.usefixtures("float32_compute")
def test_replayed_routing_gives_the_hf_backends_logprobs_update_and_mismatch(
    qwen3_moe_path: Path,
    make_cfg: Callable[..., TrainerConfig],
    megatron_cfg: Callable[..., TrainerConfig],
    tmp_path: Path,
) -> None:
    from grpo.trainer.hf.trainer import Trainer
    from grpo.trainer.megatron.trainer import MegatronTrainer
    from grpo.transport.batches.batch import TrainingBatch

    common = {
        "model": str(qwen3_moe_path),
        "learning_rate": 1e-3,
        "max_grad_norm": 0.5,
        "adam_epsilon": 1e-5,
        "routing_replay": True,
    }
    hf = Trainer(make_cfg(lora=False, optimizer="adamw", **common), tmp_path / "hf")
    megatron = MegatronTrainer(megatron_cfg(**common), tmp_path / "megatron")
    rows = _with_routing(_rows())
    replayed = megatron.score(copy.deepcopy(rows))
    for lp, ref in zip(replayed, hf.score(copy.deepcopy(rows)), strict=True):
        np.testing.assert_allclose(lp, ref, atol=2e-6, rtol=1e-6)
    own = megatron.score([dataclasses.replace(row, routed_experts=None) for row in rows])
    assert max(float(np.abs(a - b).max()) for a, b in zip(own, replayed, strict=True)) > 1e-2
    assert megatron.model.routing_replay is not None and hf.policy.routing_replay is not None
    megatron.model.routing_replay.take_metrics()
    hf.policy.routing_replay.take_metrics()

    batch = on_policy_batch(hf, 0, _rows())
    batch = TrainingBatch(step=0, rows=_with_routing(batch.rows, seed=1))
    hf_metrics = hf.train_step(copy.deepcopy(batch))
    megatron_metrics = megatron.train_step(copy.deepcopy(batch))
    assert 0.3 < hf_metrics["routing_mismatch_fraction"] < 1.0
    for key in ("loss", "entropy", "grad_norm_before_clip", "routing_mismatch_fraction"):
        assert megatron_metrics[key] == pytest.approx(hf_metrics[key], rel=1e-4, abs=1e-6), key
    after = megatron.hf_state_dict()
    assert after is not None
    hf_after = _per_expert(hf.policy.causal_lm.state_dict())
    for name, tensor in after.items():
        torch.testing.assert_close(tensor, hf_after[name], atol=1e-6, rtol=0, msg=name)
    hf.close()
    megatron.close()


@pytest.mark.usefixtures("float32_compute")
def test_published_moe_weights_after_a_step_give_the_trainers_logprobs_in_hf(
    qwen3_moe_path: Path, megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(megatron_cfg(model=str(qwen3_moe_path), learning_rate=1e-2), tmp_path)
    rows = _rows()[:1]
    trainer.train_step(on_policy_batch(trainer, 0, copy.deepcopy(rows)))
    folder = trainer.publish(1)
    assert folder is not None
    trained = trainer.score(rows)
    trainer.close()
    assert np.abs(trained[0] - reference_logprobs(qwen3_moe_path, rows)[0]).max() > 1e-2
    np.testing.assert_allclose(reference_logprobs(folder, rows)[0], trained[0], atol=2e-5)
