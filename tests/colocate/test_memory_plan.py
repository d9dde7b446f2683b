"""The co-located memory plan on CPU: what vLLM's KV cache gets, per engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.colocate.memory_plan import MIN_CPU_KV_CACHE_GB, MemoryPlan, plan_memory
from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig
from grpo.config.trainer import TrainerConfig
from grpo.models.shape import ModelShape


def _plan(model: Path, **infer: object) -> MemoryPlan:
    train = TrainerConfig.model_validate({"model": str(model), "device": "cpu"})
    orch = OrchestratorConfig.model_validate({"batch_size": 64, "seq_len": 2048})
    return plan_memory(train, InferenceConfig.model_validate({"model": str(model), **infer}), orch, model)


def test_the_kv_cache_is_sized_for_the_configured_concurrency(tiny_model_path: Path) -> None:
    plan = _plan(tiny_model_path)
    assert plan.kv_cache_space_gb is not None and plan.kv_cache_space_gb >= MIN_CPU_KV_CACHE_GB
    assert plan.gpu_memory_utilization is None
    assert "64 sequences x 2048 tokens" in plan.table()


def test_each_of_dp_engines_gets_a_cache_for_its_share_of_the_batch(tiny_model_path: Path) -> None:
    one = _plan(tiny_model_path, max_model_len=2048)
    two = _plan(tiny_model_path, max_model_len=2048, dp=2)
    assert "32 sequences x 2048 tokens" in two.table() and "2 replicas" in two.table()
    assert one.kv_cache_space_gb is not None and two.kv_cache_space_gb is not None
    assert two.kv_cache_space_gb == pytest.approx(
        max(one.kv_cache_space_gb / 2, MIN_CPU_KV_CACHE_GB), abs=0.01
    )


def test_a_user_kv_cache_size_is_an_upper_bound(tiny_model_path: Path) -> None:
    assert _plan(tiny_model_path, kv_cache_space_gb=0.3).kv_cache_space_gb == 0.3


def test_a_megatron_trainer_is_planned_with_its_own_copy_of_every_weight(embedded_model_path: Path) -> None:
    from grpo.colocate.memory_plan import MEGATRON_BYTES, trainer_rows
    from grpo.models.shape import ModelShape

    shape = ModelShape.from_folder(embedded_model_path)
    fields = {"model": str(embedded_model_path), "device": "cpu", "lora": False}
    hf = dict((name, size) for name, size, _ in trainer_rows(TrainerConfig(**fields), shape, on_gpu=False))
    megatron = TrainerConfig(**fields, backend="megatron")
    rows = {name: size for name, size, _ in trainer_rows(megatron, shape, on_gpu=False)}
    assert rows["megatron parameters"] > hf["full parameters"]  # plus its own bf16 copy of the weights
    # SmolLM2-135M: about 134.5M parameters (tied embeddings counted once).
    assert rows["megatron parameters"] == pytest.approx(134.5e6 * MEGATRON_BYTES, rel=0.01)


@pytest.mark.parametrize(
    ("recomputing", "keeping"),
    [
        # backend hf's micro-batch is one sequence_len row by default; 1024 tokens are megatron's 2 rows
        (
            {"gradient_checkpointing": True, "micro_batch_tokens": 1024},
            {"gradient_checkpointing": False, "micro_batch_tokens": 1024},
        ),
        (
            {"backend": "megatron", "megatron": {"recompute": "full"}},
            {"backend": "megatron", "megatron": {"recompute": "none"}},
        ),
    ],
    ids=["hf", "megatron"],
)
def test_a_trainer_that_keeps_every_layers_activations_is_planned_more_than_one_that_recomputes(
    recomputing: dict, keeping: dict, embedded_model_path: Path
) -> None:
    from grpo.colocate.memory_plan import trainer_rows
    from grpo.models.shape import ModelShape

    shape = ModelShape.from_folder(embedded_model_path)
    fields = {"model": str(embedded_model_path), "device": "cpu", "lora": False, "sequence_len": 512}

    def activations(extra: dict) -> int:
        rows = trainer_rows(TrainerConfig(**fields, **extra), shape, on_gpu=False)
        return next(size for name, size, _ in rows if name == "activations")

    # SmolLM2-135M, 2 rows x 512 tokens: 30 layers' 14 bf16 [1024 x 1536] tensors kept, against one
    # layer's 6 and 30 layer inputs [1024 x 576].
    tensor = 1024 * 1536 * 2
    assert activations(keeping) - activations(recomputing) == (30 * 14 - 6) * tensor - 30 * 1024 * 576 * 2


@pytest.mark.parametrize(
    ("megatron", "num_layers_kept", "num_heads"),
    [
        ({}, 30, 9),
        ({"recompute": "selective"}, 1, 9),
        ({"recompute": "full"}, 1, 9),
        ({"tensor_model_parallel_size": 3}, 30, 3),
    ],
    ids=["every-layer", "selective", "full", "tp3"],
)
def test_a_megatron_trainer_is_planned_with_its_attention_scores(
    megatron: dict, num_layers_kept: int, num_heads: int, embedded_model_path: Path
) -> None:
    from grpo.colocate.memory_plan import (
        ATTENTION_SCORE_KEPT_BYTES,
        ATTENTION_SCORE_LAYER_MARGIN_BYTES,
        ATTENTION_SCORE_WORKING_BYTES,
        trainer_rows,
    )
    from grpo.models.shape import ModelShape

    shape = ModelShape.from_folder(embedded_model_path)
    fields = {"model": str(embedded_model_path), "device": "cpu", "lora": False, "sequence_len": 512}
    train = TrainerConfig(**fields, backend="megatron", gpus=3, megatron=megatron)
    rows = {name: size for name, size, _ in trainer_rows(train, shape, on_gpu=True)}
    # SmolLM2-135M (9 heads, 30 layers), 2 rows x 512 tokens: padded calls of B x L <= 1024 tokens
    # with L <= 512 hold at most 1024 x 512 scores per head.
    num_scores = 1024 * 512 * num_heads
    per_layer = ATTENTION_SCORE_KEPT_BYTES + ATTENTION_SCORE_LAYER_MARGIN_BYTES
    per_score = num_layers_kept * per_layer + ATTENTION_SCORE_WORKING_BYTES
    assert rows["attention scores"] == num_scores * per_score
    assert rows["attention scores"] == {30: 222, 1: 19}[num_layers_kept] * num_scores
    hf = trainer_rows(TrainerConfig(**fields), shape, on_gpu=True)
    assert "attention scores" not in {name for name, _, _ in hf}


def _7b_shape() -> ModelShape:
    # Qwen2-7B: gate/up [18944, 3584], the largest linear.
    return ModelShape(3584, 18944, 28, 28, 4, 128, 152064, tied_embeddings=False)


@pytest.mark.parametrize(
    ("train_fields", "engine_quantization"),
    [({}, "fp8"), ({}, "fp8_per_block"), ({"qlora_fp8": True}, None)],
    ids=["borrowed-fp8", "borrowed-fp8-per-block", "qlora-fp8"],
)
def test_a_trainer_dequantizing_fp8_is_planned_its_buffers_and_one_chunk_of_temporaries(
    train_fields: dict, engine_quantization: str | None, tiny_model_path: Path
) -> None:
    from grpo.colocate.memory_plan import trainer_rows
    from grpo.trainer.hf.dequant import DEQUANT_CHUNK_BYTES

    train = TrainerConfig(model=str(tiny_model_path), device="cpu", **train_fields)
    rows = {name: size for name, size, _ in trainer_rows(train, _7b_shape(), True, engine_quantization)}
    assert rows["dequant buffers"] == 3 * 18944 * 3584 * 2
    # A per-tensor scale once expanded to 18944 x 18944 fp32 (1.4 GB) per matmul; now 64 MiB at most.
    assert rows["dequant temporaries"] == DEQUANT_CHUNK_BYTES == 64 * 2**20


def test_a_trainer_that_dequantizes_nothing_is_planned_no_dequantization(tiny_model_path: Path) -> None:
    from grpo.colocate.memory_plan import trainer_rows

    plain = TrainerConfig(model=str(tiny_model_path), device="cpu")
    megatron = TrainerConfig(model=str(tiny_model_path), device="cpu", lora=False, backend="megatron")
    for train, engine_quantization in [(plain, None), (megatron, "fp8")]:
        names = {name for name, _, _ in trainer_rows(train, _7b_shape(), True, engine_quantization)}
        assert not names & {"dequant buffers", "dequant temporaries"}


def test_the_plan_sizes_the_micro_batch_budget_and_says_when_layers_recompute_and_why(
    tiny_model_path: Path,
) -> None:
    plan = _plan(tiny_model_path)
    assert plan.micro_batch_tokens is not None and plan.micro_batch_tokens >= 2 * 2048
    assert plan.activation_memory_gib is not None
    table = plan.table()
    assert f"micro-batch budget {plan.micro_batch_tokens} tokens" in table
    assert "note: gradient checkpointing auto, per accumulation group: off up to " in table
    assert "the planned worst case: off: " in table  # a tiny model's activations fit any machine
    train = plan.apply_train(TrainerConfig.model_validate({"model": str(tiny_model_path)}))
    orch = plan.apply_orch(OrchestratorConfig.model_validate({"seq_len": 2048}))
    assert train.micro_batch_tokens == orch.micro_batch_tokens == orch.row_tokens == plan.micro_batch_tokens
    assert (
        train.gradient_checkpointing == "auto" and train.activation_memory_gib == plan.activation_memory_gib
    )
    rows = {name: size for name, size, _ in plan.rows}
    assert rows["activations"] >= plan.activation_memory_gib * 2**30  # the reserve is planned


def test_a_set_gradient_checkpointing_stays_as_set_in_the_plan(tiny_model_path: Path) -> None:
    train = TrainerConfig.model_validate(
        {
            "model": str(tiny_model_path),
            "device": "cpu",
            "gradient_checkpointing": True,
            "micro_batch_tokens": 4096,
        }
    )
    orch = OrchestratorConfig.model_validate({"batch_size": 64, "seq_len": 2048})
    plan = plan_memory(
        train, InferenceConfig.model_validate({"model": str(tiny_model_path)}), orch, tiny_model_path
    )
    assert plan.activation_memory_gib is None and plan.micro_batch_tokens == 4096
    assert "gradient checkpointing on, all 2 layers: gradient_checkpointing: true" in plan.table()


def test_a_steps_tokens_are_bounded_by_its_groups_shared_prompts() -> None:
    from grpo.colocate.memory_plan import max_step_tokens

    fields = {"batch_size": 64, "rollouts_per_example": 8, "seq_len": 512}
    orch = OrchestratorConfig.model_validate({**fields, "sampling": {"max_tokens": 24}})
    assert max_step_tokens(orch) == 8 * (512 + 7 * 24)
    assert max_step_tokens(OrchestratorConfig.model_validate(fields)) == 64 * 512
    plain = OrchestratorConfig.model_validate(
        {**fields, "shared_prefix": False, "sampling": {"max_tokens": 24}}
    )
    assert max_step_tokens(plain) == 64 * 512


def test_the_plan_holds_every_expert_of_a_mixture_of_experts_model(tmp_path: Path) -> None:
    from transformers import Qwen3MoeConfig

    from grpo.colocate.memory_plan import FULL_BYTES, trainer_rows
    from grpo.models.moe import parameter_counts

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    train = TrainerConfig(model=str(tmp_path), device="cpu", lora=False)
    rows = {
        name: size for name, size, _ in trainer_rows(train, ModelShape.from_folder(tmp_path), on_gpu=False)
    }
    counts = parameter_counts(config)
    assert rows["full parameters"] == counts.total * FULL_BYTES[train.optimizer]
    assert counts.total > counts.active  # the 6 experts a token skips in each layer are held too


def test_the_plan_counts_the_trainers_own_copy_of_a_vision_tower(tiny_idefics3_model_path: Path) -> None:
    from grpo.models.shape import num_vision_tower_params

    num_vision = num_vision_tower_params(tiny_idefics3_model_path)
    assert ModelShape.from_folder(tiny_idefics3_model_path).num_vision_params == num_vision > 0
    rows = {name: num_bytes for name, num_bytes, _ in _plan(tiny_idefics3_model_path).rows}
    assert rows["vision tower"] == 2 * num_vision


def test_a_cpu_trainer_is_planned_its_float32_head_copy_and_a_128_token_logits_chunk(
    tiny_model_path: Path,
) -> None:
    from grpo.colocate.memory_plan import trainer_rows

    shape = ModelShape.from_folder(tiny_model_path)
    cfg = TrainerConfig(model=str(tiny_model_path), device="cpu")
    cpu = {name: size for name, size, _ in trainer_rows(cfg, shape, on_gpu=False)}
    gpu = {name: size for name, size, _ in trainer_rows(cfg, shape, on_gpu=True)}
    assert cpu["lm_head float32 copy"] == shape.vocab_size * shape.hidden_size * 4
    assert "lm_head float32 copy" not in gpu  # CUDA multiplies the 16-bit weight into float32 output
    # Three float32 [chunk, vocab] buffers: 128 tokens a chunk on CPU, 1024 on a GPU.
    three_chunks = {
        on_gpu: min(cfg.micro_batch_token_budget, chunk) * shape.vocab_size * 12
        for on_gpu, chunk in ((False, 128), (True, 1024))
    }
    assert gpu["activations"] - cpu["activations"] == three_chunks[True] - three_chunks[False]


def test_a_cpu_engine_is_planned_its_kv_cache_in_whole_gib_its_weights_and_its_runtime(
    tiny_model_path: Path,
) -> None:
    from grpo.colocate.memory_plan import CPU_ENGINE_OVERHEAD, GIB

    plan = _plan(tiny_model_path, kv_cache_space_gb=0.3)
    rows = {name: size for name, size, _ in plan.engine_rows}
    assert rows["KV cache"] == GIB  # vLLM takes VLLM_CPU_KVCACHE_SPACE in whole GiB
    assert rows["runtime"] == CPU_ENGINE_OVERHEAD
    assert rows["weights"] == 2 * plan.shared_weight_bytes > 0
    assert plan.engine_bytes == sum(rows.values())
    # auto is float32 on a CPU: twice a bfloat16 engine's weights
    bfloat16 = _plan(tiny_model_path, kv_cache_space_gb=0.3, dtype="bfloat16")
    assert plan.shared_weight_bytes == 2 * bfloat16.shared_weight_bytes


def test_a_cpu_trainers_activations_are_planned_against_at_most_its_cpu_share(tiny_model_path: Path) -> None:
    from grpo.colocate.memory_plan import CPU_TRAINER_PLANNED_GIB
    from grpo.trainer.activation_plan import ACTIVATION_SHARE

    plan = _plan(tiny_model_path)
    assert plan.total_bytes > CPU_TRAINER_PLANNED_GIB * 2**30  # else the cap is not what is tested
    assert plan.activation_memory_gib is not None
    assert plan.activation_memory_gib <= ACTIVATION_SHARE * CPU_TRAINER_PLANNED_GIB


def test_the_plan_is_written_to_the_run_dir_with_each_processs_bytes(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    import json

    plan = _plan(tiny_model_path)
    record = json.loads(plan.write(tmp_path / "run").read_text())
    assert record["trainer_bytes"] == plan.trainer_bytes > 0
    assert record["engine_bytes"] == plan.engine_bytes > 0
    assert record["shared_weight_bytes"] == plan.shared_weight_bytes
    assert [row["name"] for row in record["engine_rows"]] == ["weights", "KV cache", "runtime"]


def test_a_trainer_borrowing_a_float32_engines_weights_is_planned_float32_activations_and_embeddings(
    tiny_model_path: Path,
) -> None:
    float32 = _plan(tiny_model_path, dtype="float32")
    bfloat16 = _plan(tiny_model_path, dtype="bfloat16")
    rows32 = {name: size for name, size, _ in float32.rows}
    rows16 = {name: size for name, size, _ in bfloat16.rows}
    assert rows32["embeddings + lm_head"] == 2 * rows16["embeddings + lm_head"]
    # a float32 head needs no float32 copy of itself
    assert "lm_head float32 copy" not in rows32 and "lm_head float32 copy" in rows16
    notes32, notes16 = " ".join(float32.notes), " ".join(bfloat16.notes)
    assert "off up to" in notes32
    # the same activation budget holds half the tokens without recomputing
    tokens32 = int(notes32.split("off up to ")[1].split(" ")[0])
    tokens16 = int(notes16.split("off up to ")[1].split(" ")[0])
    assert float32.activation_memory_gib is not None and bfloat16.activation_memory_gib is not None
    per_gib32 = tokens32 / float32.activation_memory_gib
    per_gib16 = tokens16 / bfloat16.activation_memory_gib
    assert per_gib32 == pytest.approx(per_gib16 / 2, rel=0.01)


def test_an_fp8_hybrid_trainer_is_planned_its_casts_and_a_bf16_one_none(tiny_model_path: Path) -> None:
    from grpo.colocate.memory_plan import trainer_rows

    fp8 = TrainerConfig(model=str(tiny_model_path), recipe="fp8_hybrid")
    rows = {name: size for name, size, _ in trainer_rows(fp8, _7b_shape(), True)}
    widest = 18944  # the 7B shape's intermediate size
    assert rows["fp8 casts"] == 2 * 18944 * 3584 + 2 * fp8.micro_batch_token_budget * widest
    bf16 = TrainerConfig(model=str(tiny_model_path))
    assert "fp8 casts" not in {name for name, _, _ in trainer_rows(bf16, _7b_shape(), True)}
