"""The routers' load-balancing loss (router_aux_loss_coef): each packed row's equals transformers' own
`load_balancing_loss_func` on the unpacked forward of the row's tokens (each once); a step adds
coef * its units-weighted mean to the policy loss, whatever the micro-batches and checkpointing."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from model_families import MOE_FAMILIES, VOCAB, build_family_model

import grpo.trainer.hf.model as trainer_model
from grpo.config.trainer import TrainerConfig
from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.types import Rollout
from grpo.trainer.hf.model import build_policy
from grpo.trainer.hf.moe import moe_layers
from grpo.trainer.packing import build_micro_batch
from grpo.trainer.weights import DiskWeights
from grpo.transport.batches.batch import PackedRow, TrainingBatch
from grpo.utils.errors import UserError

COEF = 0.5


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-families")


@pytest.fixture
def float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)


def _rollouts(seed: int = 0) -> list[Rollout]:
    """Two groups of three samples sharing their group's prompt."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for group in range(2):
        prompt = rng.integers(0, VOCAB, int(rng.integers(6, 12))).tolist()
        for _ in range(3):
            ids = rng.integers(0, VOCAB, int(rng.integers(3, 10))).tolist()
            rollouts.append(
                Rollout(
                    env_name="e",
                    example_index=group,
                    prompt_ids=prompt,
                    completion_ids=ids,
                    completion_mask=[True] * len(ids),
                    completion_logprobs=[float(-rng.uniform(1.0, 3.0)) for _ in ids],
                    temperature=1.0,
                    start_version=0,
                    end_version=0,
                    advantage=float(rng.normal()),
                )
            )
    return rollouts


def _layouts(rollouts: list[Rollout]) -> dict[str, list[PackedRow]]:
    packed, _ = pack_rollouts(rollouts, 40, share_prefixes=False)
    shared, _ = pack_rollouts(rollouts, 48, share_prefixes=True)
    assert len(packed) > 1 and len(shared) > 1
    assert any(r.num_loss_samples > 1 for r in packed) and sum(r.num_tokens for r in shared) < sum(
        r.num_tokens for r in packed
    )
    return {"packed": packed, "shared-prefix": shared}


def _unpacked(row: PackedRow) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row's samples as HF's right-padded batch: (input_ids [B, L], attention mask [B, L], the mask
    that counts each of the row's tokens once: a shared prefix only in its first sample)."""
    parents = row.parent_ids.tolist()
    leaves = sorted(set(range(row.num_tokens)) - set(parents))
    chains = []
    for leaf in leaves:
        chain, token = [], leaf
        while token >= 0:
            chain.append(token)
            token = parents[token]
        chains.append(chain[::-1])
    length = max(map(len, chains))
    ids = torch.zeros(len(chains), length, dtype=torch.long)
    attention = torch.zeros(len(chains), length, dtype=torch.long)
    once = torch.zeros(len(chains), length, dtype=torch.long)
    seen: set[int] = set()
    for b, chain in enumerate(chains):
        ids[b, : len(chain)] = torch.from_numpy(row.input_ids[chain].astype(np.int64))
        attention[b, : len(chain)] = 1
        for i, token in enumerate(chain):
            once[b, i] = token not in seen
            seen.add(token)
    assert len(seen) == row.num_tokens
    return ids, attention, once


def _hf_row_aux(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    """transformers' load_balancing_loss_func over the row's tokens, from HF's own unpacked forward."""
    load_balancing_loss_func = sys.modules[type(model).__module__].load_balancing_loss_func
    ids, attention, once = _unpacked(row)
    out = model(input_ids=ids, attention_mask=attention, output_router_logits=True)
    router = moe_layers(model)[0][1]
    return load_balancing_loss_func(out.router_logits, int(router.num_experts), int(router.top_k), once)


def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_each_rows_aux_loss_equals_transformers_load_balancing_loss_on_its_unpacked_tokens(
    family, family_dir, float32
):
    path = build_family_model(family, family_dir / family)
    cfg = TrainerConfig(model=str(path), lora=False, gradient_checkpointing=False, router_aux_loss_coef=COEF)
    policy = build_policy(cfg, DiskWeights(path))
    balancing = policy.load_balancing
    assert balancing is not None
    model = _hf_model(path)
    for layout, rows in _layouts(_rollouts()).items():
        mb = build_micro_batch(rows, policy.device, varlen_attention=False)  # every row in one micro-batch
        with torch.no_grad(), balancing.capture():
            policy.hidden_states(mb)
        aux = balancing.row_losses(mb)
        with torch.no_grad():
            expected = torch.stack([_hf_row_aux(model, row) for row in rows])
        torch.testing.assert_close(aux.cpu(), expected, atol=1e-6, rtol=0, msg=layout)


def _step_gradients(trainer: object, batch: TrainingBatch) -> dict[str, torch.Tensor]:
    from grpo.trainer.hf.trainer import Trainer

    assert isinstance(trainer, Trainer)
    trainer.begin_step(batch.step, trainer.cfg.loss.loss_scale(batch.num_loss_tokens, batch.num_loss_samples))
    trainer.accumulate(batch)
    grads = {
        n: p.grad.clone().cpu() for n, p in trainer.policy.causal_lm.named_parameters() if p.grad is not None
    }
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer._open = None
    return grads


def test_a_steps_gradient_is_the_policy_losss_plus_coef_times_the_aux_whatever_the_micro_batches(
    family_dir, make_cfg, float32, tmp_path
):
    from grpo.trainer.hf.trainer import Trainer

    path = build_family_model("qwen3_moe", family_dir / "qwen3_moe")
    rows = _layouts(_rollouts(1))["shared-prefix"]
    batch = TrainingBatch(step=0, rows=rows)
    loss_scale = batch.num_loss_tokens

    def cfg(**overrides: object) -> TrainerConfig:
        return make_cfg(model=str(path), lora=False, **{"gradient_checkpointing": False, **overrides})

    policy_grads = _step_gradients(Trainer(cfg(), tmp_path / "policy"), batch)
    model = _hf_model(path)
    row_aux = [_hf_row_aux(model, row) for row in rows]
    term = sum(aux * row.num_loss_tokens for aux, row in zip(row_aux, rows, strict=True)) / loss_scale
    (COEF * term).backward()
    aux_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert aux_grads.keys() < policy_grads.keys() and any(".gate." in n for n in aux_grads)
    expected = {n: g + aux_grads[n] if n in aux_grads else g for n, g in policy_grads.items()}

    settings = {
        "one micro-batch": {"micro_batch_tokens": 4096},
        "a row per micro-batch, accumulated by two": {
            "micro_batch_tokens": 48,
            "micro_batches_per_backward": 2,
        },
        "checkpointed": {"micro_batch_tokens": 48, "gradient_checkpointing": True},
    }
    for name, overrides in settings.items():
        trainer = Trainer(cfg(router_aux_loss_coef=COEF, **overrides), tmp_path / name)
        grads = _step_gradients(trainer, batch)
        assert grads.keys() == expected.keys()
        for param, ref in expected.items():
            torch.testing.assert_close(grads[param], ref, atol=1e-6, rtol=1e-5, msg=f"{name} {param}")
        metrics = trainer.train_step(batch)
        assert metrics["router_aux_loss"] == pytest.approx(float(term.detach()), abs=1e-6), name

    # Streamed (the normaliser known at the end), and per sample for a sequence ratio_type.
    trainer = Trainer(cfg(router_aux_loss_coef=COEF), tmp_path / "streamed")
    trainer.begin_step(0, None)
    trainer.accumulate(batch)
    assert trainer.finish_step()["router_aux_loss"] == pytest.approx(float(term.detach()), abs=1e-6)
    trainer = Trainer(cfg(router_aux_loss_coef=COEF, loss={"ratio_type": "sequence"}), tmp_path / "sequence")
    per_sample = sum(
        float(aux.detach()) * row.num_loss_samples for aux, row in zip(row_aux, rows, strict=True)
    )
    expected_term = per_sample / batch.num_loss_samples
    assert trainer.train_step(batch)["router_aux_loss"] == pytest.approx(expected_term, abs=1e-6)


def test_coef_0_installs_no_hooks_and_reports_no_aux_loss(family_dir, make_cfg, tmp_path):
    from grpo.trainer.hf.trainer import Trainer

    path = build_family_model("qwen3_moe", family_dir / "qwen3_moe")
    trainer = Trainer(make_cfg(model=str(path)), tmp_path)
    assert trainer.policy.load_balancing is None
    assert not any(router._forward_hooks for _, router in moe_layers(trainer.policy.causal_lm))
    metrics = trainer.train_step(TrainingBatch(step=0, rows=_layouts(_rollouts())["packed"]))
    assert "router_aux_loss" not in metrics


@contextlib.contextmanager
def _forced_topk(forced: list[torch.Tensor]) -> Iterator[None]:
    """torch.topk returning the i-th of `forced` (indices, and the values there) at its i-th call."""
    original, calls = torch.topk, iter(forced)

    def topk(values: torch.Tensor, k: int, dim: int = -1, **kwargs: object) -> object:
        ids = next(calls)
        return values.gather(-1, ids), ids

    torch.topk = topk  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.topk = original


def test_under_routing_replay_the_expert_counts_follow_the_replayed_experts(family_dir, float32):
    """HF forced to the replayed experts both in its routers and in its loss's top-k."""
    path = build_family_model("qwen3_moe", family_dir / "qwen3_moe")
    cfg = TrainerConfig(
        model=str(path),
        lora=False,
        gradient_checkpointing=False,
        router_aux_loss_coef=COEF,
        routing_replay=True,
    )
    policy = build_policy(cfg, DiskWeights(path))
    assert policy.load_balancing is not None
    layers = moe_layers(policy.causal_lm)
    num_layers, num_experts = len(policy.causal_lm.get_decoder().layers), int(layers[0][1].num_experts)
    rollout = _rollouts()[0]
    num_tokens = len(rollout.prompt_ids) + len(rollout.completion_ids)
    # Always experts 0 and 1: not the model's own routing.
    rollout.routed_experts = np.tile(np.arange(2, dtype=np.uint8), (num_tokens, num_layers, 1))
    (row,), _ = pack_rollouts([rollout], 64, share_prefixes=False)
    mb = build_micro_batch([row], policy.device, varlen_attention=False)
    with torch.no_grad(), policy.load_balancing.capture():
        policy.hidden_states(mb)
    aux = policy.load_balancing.row_losses(mb)
    model = _hf_model(path)
    replayed = [torch.from_numpy(rollout.routed_experts[:, i].astype(np.int64)) for i, _ in layers]
    with torch.no_grad(), _forced_topk(replayed * 3):  # the routers', the model's own loss's, ours
        expected = _hf_row_aux(model, row)
    with torch.no_grad():
        own = _hf_row_aux(model, row)
    torch.testing.assert_close(aux.cpu(), expected[None], atol=1e-6, rtol=0)
    assert abs(float(aux) - float(own)) > 0.1 and num_experts == 4  # the replayed counts made the difference


def test_router_aux_loss_is_refused_on_a_dense_model_and_under_backend_megatron(family_dir, float32):
    path = build_family_model("llama", family_dir / "llama")
    cfg = TrainerConfig(model=str(path), lora=False, router_aux_loss_coef=COEF)
    with pytest.raises(
        UserError, match="llama has no mixture-of-experts layers; set router_aux_loss_coef: 0"
    ):
        build_policy(cfg, DiskWeights(path))
    with pytest.raises(ValueError, match="router_aux_loss_coef > 0 is implemented by backend hf only"):
        TrainerConfig(model="m", lora=False, backend="megatron", router_aux_loss_coef=COEF)
