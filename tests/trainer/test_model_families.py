"""Every model family the HF trainer accepts gives the logprobs and gradients of the model's own
unpacked forward, under every attention implementation it accepts; what it would get wrong is
refused at load, by name.

The reference is HF's plain forward of each rollout on its own in float32 (eager attention, HF's own
masks and windows, the CausalLM's own logits), independent of the trainer's packing and masks. The
trainer side is the training path itself: packed micro-batches, the policy's decoder calls and the
chunked lm_head, on rows holding one sequence each, several sequences each, and prefix trees.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from model_families import FAMILIES, VOCAB, build_family_model

import grpo.trainer.hf.model as trainer_model
from grpo.config.trainer import TrainerConfig
from grpo.orchestrator.batching.packer import pack_rollouts
from grpo.orchestrator.types import Rollout
from grpo.trainer.hf.attention import check_attention
from grpo.trainer.hf.model import Policy, build_policy
from grpo.trainer.logprobs import token_logprobs
from grpo.trainer.packing import build_micro_batch
from grpo.trainer.weights import DiskWeights
from grpo.transport.batches.batch import PackedRow
from grpo.utils.errors import UserError

IMPLEMENTATIONS = ["eager", "sdpa"]
LOADED_WITH_EAGER = {"gemma2", "gpt_oss"}
"""Families the trainer loads with eager attention on CPU; the others load with sdpa."""
HAS_SINKS = {"gpt_oss"}
"""Families with attention sinks, which the trainer never runs under FlexAttention (transformers'
sink correction rounds the log-sum-exp to 16 bits, and cannot run on CPU)."""


def _matrix() -> list[object]:
    """Every family under both implementations. In the default run: each family as the trainer loads
    it, Llama under eager too, and the refusals; the other implementation of each family is `slow`."""
    cases: list[object] = []
    for family in FAMILIES:
        loaded_with = "eager" if family in LOADED_WITH_EAGER else "sdpa"
        for implementation in IMPLEMENTATIONS:
            extra = implementation != loaded_with and family != "llama" and family not in LOADED_WITH_EAGER
            marks = [pytest.mark.slow] if extra else []
            cases.append(pytest.param(family, implementation, marks=marks, id=f"{family}-{implementation}"))
        if family not in HAS_SINKS:  # FlexAttention's backward runs on CUDA only
            cases.append(pytest.param(family, "flex_attention", marks=[pytest.mark.gpu], id=f"{family}-flex"))
    return cases


def _flex_families() -> list[object]:
    """FlexAttention on CPU, forward only: Llama and Gemma-2 (mixed windows, soft-capped scores) in
    the default run, the rest `slow` (each compiles its own kernels, about 15 s here)."""
    default = {"llama", "gemma2"}
    return [
        pytest.param(family, marks=[] if family in default else [pytest.mark.slow])
        for family in FAMILIES
        if family not in HAS_SINKS
    ]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def _rollouts(seed: int = 0) -> list[Rollout]:
    """Two groups of three (prompts of 6-11 tokens, completions of 3-9, longer than the window)."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for group in range(2):
        prompt = rng.integers(0, VOCAB, int(rng.integers(6, 12))).tolist()
        temperature = [0.7, 1.0][group]
        for _ in range(3):
            ids = rng.integers(0, VOCAB, int(rng.integers(3, 10))).tolist()
            rollouts.append(
                Rollout(
                    env_name="e",
                    example_index=group,
                    prompt_ids=prompt,
                    completion_ids=ids,
                    completion_mask=[True] * len(ids),
                    # Distinct per token: they name each loss token across layouts.
                    completion_logprobs=[float(-rng.uniform(1.0, 3.0)) for _ in ids],
                    temperature=temperature,
                    start_version=0,
                    end_version=0,
                    advantage=1.0,
                )
            )
    return rollouts


def _weight(key: torch.Tensor) -> torch.Tensor:
    """Each loss token's weight in the test objective (from its name; in [-1, 1])."""
    return key + 2.0


_REFERENCES: dict[Path, tuple[dict[float, float], dict[str, torch.Tensor]]] = {}


def _reference(path: Path, rollouts: list[Rollout]) -> tuple[dict[float, float], dict[str, torch.Tensor]]:
    """Logprob of every completion token (by name) and the objective's gradient, from HF alone
    (computed once per model: every test here uses the same rollouts)."""
    if path not in _REFERENCES:
        _REFERENCES[path] = _unpacked_forwards(path, rollouts)
    return _REFERENCES[path]


def _unpacked_forwards(
    path: Path, rollouts: list[Rollout]
) -> tuple[dict[float, float], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    logprobs: dict[float, float] = {}
    for rollout in rollouts:
        ids = torch.tensor(rollout.prompt_ids + rollout.completion_ids)
        logits = model(input_ids=ids[None]).logits[0, :-1] / rollout.temperature  # predicts ids[1:]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
        completion_lp = lp[len(rollout.prompt_ids) - 1 :]
        keys = torch.tensor(rollout.completion_logprobs)
        (_weight(keys) * completion_lp).sum().backward()
        logprobs.update(zip(keys.tolist(), completion_lp.tolist(), strict=True))
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return logprobs, grads


def _trainer_side(
    policy: Policy, rows: list[PackedRow]
) -> tuple[dict[float, float], dict[str, torch.Tensor]]:
    """The same through the trainer: packed micro-batches, the policy's forward, the chunked head."""
    policy.model.zero_grad(set_to_none=True)
    logprobs = _trainer_logprobs(policy, rows, backward=True)
    # On a CUDA machine the trainer runs there; the reference stays on the CPU.
    grads = {name: p.grad.cpu() for name, p in policy.causal_lm.named_parameters() if p.grad is not None}
    return logprobs, grads


def _trainer_logprobs(policy: Policy, rows: list[PackedRow], backward: bool = False) -> dict[float, float]:
    """Each completion token's logprob (by name) through the trainer's forward, each row its own
    micro-batch; `backward` accumulates the test objective's gradient."""
    logprobs: dict[float, float] = {}
    for row in rows:
        mb = build_micro_batch([row], policy.device, policy.uses_varlen_attention)
        hidden = policy.hidden_states(mb)
        tokens = mb.loss
        lp, _ = token_logprobs(
            hidden[tokens.predicted_from], policy.lm_head, tokens.targets, tokens.temperatures, chunk_size=7
        )
        if backward:
            (_weight(tokens.inference_logprobs) * lp).sum().backward()
        logprobs.update(zip(tokens.inference_logprobs.tolist(), lp.tolist(), strict=True))
    return logprobs


def _layouts(rollouts: list[Rollout]) -> dict[str, list[PackedRow]]:
    plain = [row for r in rollouts for row in pack_rollouts([r], 64, share_prefixes=False)[0]]
    packed, _ = pack_rollouts(rollouts, 64, share_prefixes=False)
    shared, _ = pack_rollouts(rollouts, 256, share_prefixes=True)
    assert len(packed) < len(plain) and sum(r.num_tokens for r in shared) < sum(r.num_tokens for r in packed)
    return {"plain": plain, "packed": packed, "shared-prefix": shared}


def _policy(path: Path, implementation: str, monkeypatch: pytest.MonkeyPatch) -> Policy:
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)
    cfg = TrainerConfig(model=str(path), lora=False, optimizer="adamw", gradient_checkpointing=False)
    policy = build_policy(cfg, DiskWeights(path))
    if policy.causal_lm.config._attn_implementation != implementation:
        policy.causal_lm.set_attn_implementation(implementation)
        check_attention(policy.causal_lm)  # what build_policy checks, for this implementation
    return policy


@pytest.mark.parametrize(("family", "implementation"), _matrix())
def test_trainer_logprobs_and_gradients_equal_the_unpacked_hf_forward(
    family, implementation, family_dir, monkeypatch
):
    path = build_family_model(family, family_dir / family)
    if family == "gemma2" and implementation == "sdpa":
        with pytest.raises(UserError, match="gemma2 soft-caps attention scores"):
            _policy(path, implementation, monkeypatch)
        return
    if family == "gpt_oss" and implementation == "sdpa":
        # transformers itself refuses: its sdpa path has no attention sinks
        with pytest.raises(ValueError, match="does not support an attention implementation"):
            _policy(path, implementation, monkeypatch)
        return
    policy = _policy(path, implementation, monkeypatch)
    assert policy.causal_lm.config._attn_implementation == implementation
    rollouts = _rollouts()
    ref_lp, ref_grads = _reference(path, rollouts)
    for layout, rows in _layouts(rollouts).items():
        lp, grads = _trainer_side(policy, rows)
        assert lp.keys() == ref_lp.keys()
        np.testing.assert_allclose(
            [lp[k] for k in ref_lp], list(ref_lp.values()), atol=1e-5, rtol=0, err_msg=f"{layout} logprobs"
        )
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            # float32 sums in another order: within 1e-5 of the gradient's scale
            scale = max(1.0, float(ref.abs().max()))
            torch.testing.assert_close(
                grads[name],
                ref,
                atol=1e-5 * scale,
                rtol=1e-4,
                msg=lambda m, name=name, layout=layout: f"{layout} {name}: {m}",
            )


@pytest.mark.parametrize("family", _flex_families())
def test_flex_attention_with_the_tree_block_mask_gives_the_unpacked_hf_logprobs(
    family, family_dir, monkeypatch
):
    """The GPU default's kernel, its block mask built from each row's prefix tree (windows and
    soft-caps in the same mask and score functions), on CPU where torch runs FlexAttention's forward
    but has no backward: the logprobs of every layout, not the gradients (those are the `-flex`
    cases above, on CUDA)."""
    # Inductor's CPU FlexAttention kernel fails to compile once a second shape makes it dynamic
    # (torch 2.13: an undeclared kvSplitSize); one static kernel per shape sidesteps that here.
    static_shapes = torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=64)
    path = build_family_model(family, family_dir / family)
    policy = _policy(path, "flex_attention", monkeypatch)
    rollouts = _rollouts()
    ref_lp, _ = _reference(path, rollouts)
    for layout, rows in _layouts(rollouts).items():
        with torch.no_grad(), static_shapes:
            lp = _trainer_logprobs(policy, rows)
        assert lp.keys() == ref_lp.keys()
        np.testing.assert_allclose(
            [lp[k] for k in ref_lp], list(ref_lp.values()), atol=1e-5, rtol=0, err_msg=f"{layout} logprobs"
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trainer_loads_each_family_with_an_implementation_it_computes_exactly(
    family, family_dir, monkeypatch
):
    """Without a choice of the user's: on CPU sdpa where it is exact, eager where sdpa would drop part
    of the model (Gemma-2's attention soft-cap) or where the model has no sdpa (gpt-oss's sinks); on
    CUDA FlexAttention, except for gpt-oss (eager)."""
    path = build_family_model(family, family_dir / family)
    monkeypatch.setattr(trainer_model, "choose_dtype", lambda device: torch.float32)
    policy = build_policy(TrainerConfig(model=str(path), lora=False, optimizer="adamw"), DiskWeights(path))
    expected = "eager" if family in LOADED_WITH_EAGER else "sdpa"
    if torch.cuda.is_available():
        expected = "eager" if family in HAS_SINKS else "flex_attention"
    assert policy.causal_lm.config._attn_implementation == expected


def test_lora_targets_a_model_lacks_are_refused_by_name(family_dir):
    path = build_family_model("phi3", family_dir / "phi3")
    cfg = TrainerConfig(model=str(path), optimizer="adamw")  # default targets: q_proj, k_proj, ...
    with pytest.raises(
        UserError, match=r"phi3 has no q_proj, k_proj, v_proj, gate_proj, up_proj modules.*qkv_proj"
    ):
        build_policy(cfg, DiskWeights(path))
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    policy = build_policy(cfg.model_copy(update={"lora_target_modules": targets}), DiskWeights(path))
    adapted = {n.split(".")[-2] for n, _ in policy.model.named_modules() if n.endswith(".lora_A")}
    assert adapted == set(targets)


def test_borrowed_weights_under_names_the_model_lacks_are_refused_by_name(family_dir):
    from grpo.trainer.device import resolve_device
    from grpo.trainer.weights import BorrowedWeights

    path = build_family_model("phi3", family_dir / "phi3")
    # What the engine's qkv_proj becomes after the co-located split into HF's Llama names.
    cfg = TrainerConfig(model=str(path), optimizer="adamw", lora_target_modules=["o_proj"])
    zeros = torch.zeros(64, 64, dtype=torch.float32, device=resolve_device(cfg))  # lent where it computes
    borrowed = {"model.layers.0.self_attn.q_proj.weight": zeros}
    with pytest.raises(UserError, match="phi3: the engine's base weights do not map"):
        build_policy(cfg, BorrowedWeights(path, borrowed))
