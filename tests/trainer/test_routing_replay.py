"""Rollout routing replay (R3) on every MoE family: the trainer, told which experts each token went
to, gives the logprobs and gradients of HF's own unpacked forward forced to the same experts, on
plain, packed and shared-prefix rows; its metric counts the tokens whose own routing differs.

The reference forces HF's routers through their own code: `torch.topk`, which each router calls
once to choose its experts, returns the given experts (and their values), so the scores are those
HF's router computes for them.
"""

from __future__ import annotations

import contextlib
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
from grpo.trainer.hf.model import Policy, build_policy
from grpo.trainer.hf.moe import moe_layers
from grpo.trainer.logprobs import token_logprobs
from grpo.trainer.packing import build_micro_batch
from grpo.trainer.weights import DiskWeights
from grpo.transport.batches.batch import PackedRow
from grpo.utils.errors import UserError


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-families")


@contextlib.contextmanager
def _topk(forced: list[torch.Tensor] | None, recorded: list[torch.Tensor]) -> Iterator[None]:
    """torch.topk returning `forced[i]` at its i-th call (the i-th MoE layer) when given, and
    recording what it returns."""
    original = torch.topk
    calls = iter(forced) if forced is not None else None

    def topk(values: torch.Tensor, k: int, dim: int = -1, **kwargs: object) -> object:
        if calls is None:
            out = original(values, k, dim=dim, **kwargs)
            recorded.append(out.indices)
            return out
        ids = next(calls)
        recorded.append(ids)
        return values.gather(-1, ids), ids

    torch.topk = topk  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.topk = original


def _rollouts(num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> list[Rollout]:
    """Two groups of three; random distinct experts per token and layer, one routing per group prompt."""
    rng = np.random.default_rng(seed)

    def routing(num_tokens: int) -> np.ndarray:
        choice = [rng.permutation(num_experts)[:top_k] for _ in range(num_tokens * num_layers)]
        return np.asarray(choice, dtype=np.uint8).reshape(num_tokens, num_layers, top_k)

    rollouts = []
    for group in range(2):
        prompt = rng.integers(0, VOCAB, int(rng.integers(6, 12))).tolist()
        prompt_routing = routing(len(prompt))
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
                    temperature=[0.7, 1.0][group],
                    start_version=0,
                    end_version=0,
                    advantage=1.0,
                    routed_experts=np.concatenate([prompt_routing, routing(len(ids))]),
                )
            )
    return rollouts


def _hf_forced(path: Path, rollouts: list[Rollout]) -> tuple[dict[float, float], dict[str, torch.Tensor]]:
    """Logprobs by name and the objective's gradient from HF's plain float32 forward of each rollout,
    its routers forced to the rollout's routing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    moe_indices = [index for index, _ in moe_layers(model)]
    logprobs: dict[float, float] = {}
    for rollout in rollouts:
        assert rollout.routed_experts is not None
        routing = torch.from_numpy(rollout.routed_experts.astype(np.int64))
        ids = torch.tensor(rollout.prompt_ids + rollout.completion_ids)
        with _topk([routing[:, index] for index in moe_indices], []):
            logits = model(input_ids=ids[None]).logits[0, :-1] / rollout.temperature
        lp = (
            torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)[len(rollout.prompt_ids) - 1 :]
        )
        keys = torch.tensor(rollout.completion_logprobs)
        ((keys + 2.0) * lp).sum().backward()
        logprobs.update(zip(keys.tolist(), lp.tolist(), strict=True))
    return logprobs, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _trainer(policy: Policy, rows: list[PackedRow]) -> tuple[dict[float, float], dict[str, torch.Tensor]]:
    policy.model.zero_grad(set_to_none=True)
    logprobs: dict[float, float] = {}
    for row in rows:
        mb = build_micro_batch([row], policy.device, policy.uses_varlen_attention)
        tokens = mb.loss
        lp, _ = token_logprobs(
            policy.hidden_states(mb)[tokens.predicted_from],
            policy.lm_head,
            tokens.targets,
            tokens.temperatures,
            chunk_size=7,
        )
        ((tokens.inference_logprobs + 2.0) * lp).sum().backward()
        logprobs.update(zip(tokens.inference_logprobs.tolist(), lp.tolist(), strict=True))
    return logprobs, {n: p.grad.cpu() for n, p in policy.causal_lm.named_parameters() if p.grad is not None}


def _policy(path: Path, monkeypatch: pytest.MonkeyPatch, **overrides: object) -> Policy:
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)
    cfg = TrainerConfig(
        model=str(path), lora=False, optimizer="adamw", gradient_checkpointing=False, routing_replay=True
    )
    return build_policy(cfg.model_copy(update=overrides), DiskWeights(path))


def _shape(policy: Policy) -> tuple[int, int, int]:
    """(decoder layers, experts, top_k): routing is indexed by decoder layer, as vLLM records it."""
    router = moe_layers(policy.causal_lm)[0][1]
    return len(policy.causal_lm.get_decoder().layers), int(router.num_experts), int(router.top_k)


def _layouts(rollouts: list[Rollout]) -> dict[str, list[PackedRow]]:
    plain = [row for r in rollouts for row in pack_rollouts([r], 64, share_prefixes=False)[0]]
    packed, _ = pack_rollouts(rollouts, 64, share_prefixes=False)
    shared, _ = pack_rollouts(rollouts, 256, share_prefixes=True)
    assert len(packed) < len(plain) and sum(r.num_tokens for r in shared) < sum(r.num_tokens for r in packed)
    return {"plain": plain, "packed": packed, "shared-prefix": shared}


@pytest.mark.parametrize(
    ("family", "checkpointing"), [*((f, False) for f in MOE_FAMILIES), ("qwen2_moe", True)]
)
def test_replayed_routing_gives_hf_forward_forced_to_the_same_experts(
    family, checkpointing, family_dir, monkeypatch
):
    """With gradient checkpointing the backward's recomputation replays the same experts."""
    path = build_family_model(family, family_dir / family)
    policy = _policy(path, monkeypatch, gradient_checkpointing=checkpointing)
    if checkpointing:
        policy.causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert policy.routing_replay is not None
    rollouts = _rollouts(*_shape(policy))
    ref_lp, ref_grads = _hf_forced(path, rollouts)
    for layout, rows in _layouts(rollouts).items():
        lp, grads = _trainer(policy, rows)
        np.testing.assert_allclose(
            [lp[k] for k in ref_lp], list(ref_lp.values()), atol=1e-5, rtol=0, err_msg=f"{layout} logprobs"
        )
        assert grads.keys() == ref_grads.keys()
        assert any("router" in n or ".gate." in n for n in grads)  # the router learns
        for name, ref in ref_grads.items():
            scale = max(1.0, float(ref.abs().max()))
            torch.testing.assert_close(grads[name], ref, atol=1e-5 * scale, rtol=1e-4, msg=f"{layout} {name}")
        differing, replayed = policy.routing_replay.take_mismatch()
        # random experts: most tokens' own top-2 of 4 (8) differs from them somewhere
        assert replayed == sum(r.num_tokens for r in rows) and differing > replayed // 2, layout


def _own_routing(path: Path, rollouts: list[Rollout], perturb: float) -> None:
    """Set each rollout's routed_experts to the routing of the model (router weights perturbed by
    noise of std `perturb`), as an engine with other numerics would record it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(1)
    with torch.no_grad():
        for _, router in moe_layers(model):
            router.weight.add_(torch.randn_like(router.weight) * perturb)
        for rollout in rollouts:
            recorded: list[torch.Tensor] = []
            with _topk(None, recorded):
                model(input_ids=torch.tensor([rollout.prompt_ids + rollout.completion_ids]))
            assert rollout.routed_experts is not None
            for (index, _), ids in zip(moe_layers(model), recorded, strict=True):
                rollout.routed_experts[:, index] = ids.numpy()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_mismatch_metric_is_zero_for_the_models_own_routing_and_positive_for_a_perturbed_models(
    family, family_dir, monkeypatch
):
    path = build_family_model(family, family_dir / family)
    policy = _policy(path, monkeypatch)
    assert policy.routing_replay is not None
    rollouts = _rollouts(*_shape(policy))
    for perturb, expect_differing in ((0.0, False), (0.3, True)):
        _own_routing(path, rollouts, perturb)
        rows, _ = pack_rollouts(rollouts, 256, share_prefixes=False)
        with torch.no_grad():
            for row in rows:
                policy.hidden_states(build_micro_batch([row], policy.device, False))
        differing, replayed = policy.routing_replay.take_mismatch()
        assert replayed == sum(r.num_tokens for r in rows)
        assert (differing > 0) == expect_differing, (perturb, differing)


def test_routing_replay_on_a_dense_model_is_refused_at_load(family_dir, monkeypatch):
    path = build_family_model("llama", family_dir / "llama")
    with pytest.raises(UserError, match="llama has no mixture-of-experts layers; set routing_replay: false"):
        _policy(path, monkeypatch)


def test_lora_on_a_moe_model_defaults_to_attention(family_dir, monkeypatch):
    path = build_family_model("qwen3_moe", family_dir / "qwen3_moe")
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)
    policy = build_policy(TrainerConfig(model=str(path), optimizer="adamw"), DiskWeights(path))
    adapted = {n.split(".")[-2] for n, _ in policy.model.named_modules() if n.endswith(".lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_moe_settings_the_trainer_does_not_implement_are_refused_at_load(tmp_path):
    with pytest.raises(ValueError, match="routing_replay under backend megatron needs megatron\\.recompute"):
        TrainerConfig(
            model="m", routing_replay=True, backend="megatron", lora=False, megatron={"recompute": "full"}
        )
    TrainerConfig(model="m", routing_replay=True, backend="megatron", lora=False)
    with pytest.raises(ValueError, match="routing_replay on several GPUs is implemented by backend megatron"):
        TrainerConfig(model="m", routing_replay=True, gpus=2)
    megatron = {"model": "m", "routing_replay": True, "backend": "megatron", "lora": False, "gpus": 2}
    TrainerConfig(**megatron, megatron={"expert_model_parallel_size": 2})
    with pytest.raises(ValueError, match="routing_replay on several GPUs"):
        TrainerConfig(**megatron, megatron={"tensor_model_parallel_size": 2})
    assert (
        TrainerConfig(model="m").router_aux_loss_coef == 0.0 and not TrainerConfig(model="m").routing_replay
    )


def test_a_training_step_reports_the_routing_mismatch_and_refuses_a_batch_without_routing(
    family_dir, make_cfg, tmp_path
):
    from grpo.trainer.hf.trainer import Trainer
    from grpo.transport.batches.batch import TrainingBatch

    path = build_family_model("qwen3_moe", family_dir / "qwen3_moe")
    trainer = Trainer(make_cfg(model=str(path), routing_replay=True), tmp_path)
    assert trainer.policy.routing_replay is not None
    rollouts = _rollouts(*_shape(trainer.policy))
    _own_routing(path, rollouts, perturb=0.3)  # an engine whose numerics differ
    rows, _ = pack_rollouts(rollouts, 256, share_prefixes=True)
    metrics = trainer.train_step(TrainingBatch(step=0, rows=rows))
    assert 0.0 < metrics["routing_mismatch_fraction"] < 1.0
    for row in rows:
        row.routed_experts = None
    with pytest.raises(
        UserError, match="carries no routed_experts: start grpo-infer with return_routed_experts"
    ):
        trainer.train_step(TrainingBatch(step=1, rows=rows))
    trainer.close()
