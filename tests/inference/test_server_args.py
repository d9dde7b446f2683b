"""InferenceConfig -> vLLM server argv and environment, without starting vLLM."""

from __future__ import annotations

import json

import pytest

from grpo.config.inference import InferenceConfig
from grpo.inference.server_args import (
    build_server_args,
    engine_runs_compiled,
    resolve_lora_serving,
    server_env,
)
from grpo.inference.vllm_compat.version import WORKER_EXTENSION_CLS, check_vllm_version


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_config_key_reaches_the_server_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "k-123-a-long-enough-key")
    cfg = InferenceConfig(
        model="org/model",
        host="0.0.0.0",
        port=8123,
        dtype="bfloat16",
        max_model_len=4096,
        enforce_eager=True,
        trust_remote_code=True,
        tp=2,
        dp=3,
        max_lora_rank=12,
        max_loras=4,
        max_cpu_loras=50,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
        seed=7,
        max_num_seqs=64,
        max_logprobs=-1,
        block_size=64,
        api_key_var="MY_KEY",
    )
    argv = build_server_args(cfg, "/models/m")
    assert option(argv, "--model") == "/models/m"
    assert option(argv, "--served-model-name") == "org/model"
    assert option(argv, "--host") == "0.0.0.0"
    assert option(argv, "--port") == "8123"
    assert option(argv, "--dtype") == "bfloat16"
    assert option(argv, "--max-model-len") == "4096"
    assert "--enforce-eager" in argv and "--trust-remote-code" in argv
    assert option(argv, "--tensor-parallel-size") == "2"
    assert option(argv, "--data-parallel-size") == "3"
    assert "--enable-lora" in argv
    assert option(argv, "--max-lora-rank") == "16"  # 12 rounded up to a rank vLLM accepts
    assert option(argv, "--max-loras") == "4"
    assert option(argv, "--max-cpu-loras") == "50"
    assert "--no-enable-prefix-caching" in argv
    assert option(argv, "--gpu-memory-utilization") == "0.5"
    assert option(argv, "--reasoning-parser") == "qwen3"
    assert "--enable-auto-tool-choice" in argv and option(argv, "--tool-call-parser") == "hermes"
    assert json.loads(option(argv, "--hf-overrides")) == {
        "head_dtype": "float32",
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
    }
    assert option(argv, "--seed") == "7"
    assert option(argv, "--max-num-seqs") == "64"
    assert option(argv, "--max-logprobs") == "-1"
    assert option(argv, "--block-size") == "64"
    assert option(argv, "--worker-extension-cls") == WORKER_EXTENSION_CLS
    assert option(argv, "--api-key") == "k-123-a-long-enough-key"
    assert option(argv, "--logprobs-mode") == "processed_logprobs"


def test_defaults_bind_loopback_and_leave_optional_settings_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    argv = build_server_args(InferenceConfig(model="m"), "/models/m", on_cpu=False)
    assert option(argv, "--host") == "127.0.0.1"
    assert option(argv, "--max-lora-rank") == "64"
    for flag in (
        "--api-key",
        "--max-model-len",
        "--max-num-seqs",
        "--max-logprobs",
        "--enforce-eager",
        "--block-size",
    ):
        assert flag not in argv
    # float32 logits from the lm_head, as the trainer computes them (the step-0 mismatch)
    assert json.loads(option(argv, "--hf-overrides")) == {"head_dtype": "float32"}
    assert not any("prefix-caching" in arg for arg in argv)


@pytest.mark.parametrize("on_cpu", [True, False])
@pytest.mark.parametrize("overrides", [{}, {"enable_lora": False}, {"dp": 2}, {"quantization": "fp8"}])
def test_the_server_takes_no_sampling_defaults_from_the_checkpoint(
    on_cpu: bool, overrides: dict[str, object]
) -> None:
    # With the default (auto), vLLM fills every setting a request leaves out from the checkpoint's
    # generation_config.json (Qwen3: top_k 20, top_p 0.95).
    argv = build_server_args(InferenceConfig(model="m", **overrides), "/models/m", on_cpu=on_cpu)  # type: ignore[arg-type]
    assert option(argv, "--generation-config") == "vllm"


@pytest.mark.parametrize(("amx", "expected"), [(False, "16"), (True, "32")])
def test_a_cpu_engine_gets_blocks_small_enough_for_a_group_to_share_a_short_prompt(
    amx: bool, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM-CPU's own 128-token blocks left a 44-token prompt without a whole block to share; AMX's
    # attention kernel takes multiples of 32 only.
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    argv = build_server_args(InferenceConfig(model="m"), "/models/m", on_cpu=True)
    assert option(argv, "--block-size") == expected
    argv = build_server_args(InferenceConfig(model="m", block_size=128), "/models/m", on_cpu=True)
    assert option(argv, "--block-size") == "128"
    assert "--block-size" not in build_server_args(InferenceConfig(model="m"), "/models/m", on_cpu=False)


def test_a_cpu_block_size_vllm_cannot_run_is_refused_before_start_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"block_size 40: .*multiple of 16 tokens; set block_size to 16"):
        build_server_args(InferenceConfig(model="m", block_size=40), "/models/m", on_cpu=True)
    argv = build_server_args(InferenceConfig(model="m", block_size=40), "/models/m", on_cpu=False)
    assert option(argv, "--block-size") == "40"
    argv = build_server_args(InferenceConfig(model="m", block_size=48), "/models/m", on_cpu=True)
    assert option(argv, "--block-size") == "48"


def test_lora_flags_are_absent_when_lora_is_off() -> None:
    argv = build_server_args(InferenceConfig(model="m", enable_lora=False), "/m")
    assert not any("lora" in arg for arg in argv)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server_env(InferenceConfig(model="m", enable_lora=False))


def test_auto_tool_choice_without_a_parser_is_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match="tool_call_parser"):
        build_server_args(InferenceConfig(model="m", enable_auto_tool_choice=True), "/m")


def test_cpu_env_sizes_the_kv_cache_in_whole_gib_and_keeps_dense_weights() -> None:
    env = server_env(InferenceConfig(model="m", kv_cache_space_gb=1.5), on_cpu=True)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["GRPO_KEEP_DENSE_WEIGHTS"] == "1"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env  # auto on CPU merges: no runtime adapters
    assert server_env(InferenceConfig(model="m"), on_cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    gpu_env = server_env(InferenceConfig(model="m"), on_cpu=False)
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu_env and "GRPO_KEEP_DENSE_WEIGHTS" not in gpu_env
    assert gpu_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_a_cpu_engine_records_kept_counts_and_a_gpu_one_is_told_not_to() -> None:
    # stated either way: a GPU server started after a CPU one in the same process must not inherit it
    assert server_env(InferenceConfig(model="m"), on_cpu=True)["GRPO_RECORD_KEPT_COUNTS"] == "1"
    assert server_env(InferenceConfig(model="m"), on_cpu=False)["GRPO_RECORD_KEPT_COUNTS"] == "0"


def test_a_cpu_engine_takes_the_compile_cache_it_can_load_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert server_env(InferenceConfig(model="m"), on_cpu=True)["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in server_env(InferenceConfig(model="m"), on_cpu=False)
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert "VLLM_USE_AOT_COMPILE" not in server_env(InferenceConfig(model="m"), on_cpu=True)


def test_on_cuda_engines_are_spawned_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert server_env(InferenceConfig(model="m"), on_cpu=False)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in server_env(InferenceConfig(model="m"), on_cpu=True)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in server_env(InferenceConfig(model="m"), on_cpu=False)


@pytest.mark.parametrize(
    ("fields", "on_cpu", "expected"),
    [
        ({}, True, "merged"),
        ({}, False, "adapter"),
        ({"tp": 2}, True, "adapter"),
        ({"quantization": "fp8_per_block", "dtype": "bfloat16"}, True, "adapter"),
        ({"dtype": "bfloat16"}, True, "adapter"),
        ({"lora_serving": "adapter"}, True, "adapter"),
        ({"lora_serving": "merged"}, True, "merged"),
    ],
)
def test_auto_lora_serving_merges_on_cpu_only_where_merging_is_exact(
    fields: dict[str, object], on_cpu: bool, expected: str
) -> None:
    cfg = InferenceConfig.model_validate({"model": "m", **fields})
    assert resolve_lora_serving(cfg, on_cpu=on_cpu) == expected
    argv = build_server_args(cfg, "/m", on_cpu=on_cpu)
    # A merging engine runs as the base model: none of vLLM's LoRA layers.
    assert ("--enable-lora" in argv) == (expected == "adapter")
    assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING" in server_env(cfg, on_cpu=on_cpu)) == (expected == "adapter")


def test_merged_lora_serving_in_16_bits_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"dtype bfloat16.*set dtype: float32 \(or auto\), or lora_serving: adapter"
    ):
        InferenceConfig(model="m", lora_serving="merged", dtype="bfloat16")


def test_merged_lora_serving_on_gpu_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"CPU backend only.*set lora_serving to adapter"):
        resolve_lora_serving(InferenceConfig(model="m", lora_serving="merged"), on_cpu=False)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"tp": 2}, "lora_serving merged with tp 2.*set lora_serving to adapter"),
        (
            {"quantization": "fp8_per_block", "dtype": "bfloat16"},
            "lora_serving merged with quantization fp8_per_block.*set lora_serving to adapter",
        ),
        ({"lora_serving": "fused"}, "lora_serving"),
    ],
)
def test_config_refuses_merged_serving_where_it_cannot_be_exact(
    fields: dict[str, object], match: str
) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        InferenceConfig.model_validate({"model": "m", "lora_serving": "merged", **fields})


@pytest.mark.parametrize("version", ["0.25.0", "0.31.2", "0.33.0", "1.0.0"])
def test_vllm_outside_the_tested_range_is_refused(version: str) -> None:
    from grpo.utils.errors import UserError

    with pytest.raises(UserError, match="not supported"):
        check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu"])
def test_vllm_inside_the_tested_range_is_accepted(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.vllm
def test_vllms_own_parser_accepts_the_argv() -> None:
    from grpo.inference.vllm_compat.version import parse_server_args

    cfg = InferenceConfig(
        model="org/model", max_model_len=256, rope_scaling={"rope_type": "linear", "factor": 2.0}
    )
    args = parse_server_args(build_server_args(cfg, "/models/m", on_cpu=False))
    assert args.served_model_name == ["org/model"]
    assert args.enable_lora and args.max_lora_rank == 64
    assert args.hf_overrides == {
        "head_dtype": "float32",
        "rope_parameters": {"rope_type": "linear", "factor": 2.0},
    }
    assert args.worker_extension_cls == WORKER_EXTENSION_CLS
    assert args.generation_config == "vllm"


def test_installed_vllm_is_in_the_supported_range() -> None:
    """Weight borrowing reads vLLM internals: an untested release must fail here, not mid-run."""
    check_vllm_version()


def test_routed_experts_are_asked_of_a_gpu_engine_and_recorded_by_grpo_on_an_uncached_cpu_engine() -> None:
    from grpo.inference.server_args import server_env
    from grpo.inference.vllm_compat.routing_capture import RECORD_ROUTING_ENV

    cfg = InferenceConfig(model="m", return_routed_experts=True)
    assert "--enable-return-routed-experts" in build_server_args(cfg, "/models/m", on_cpu=False)
    assert "--enable-return-routed-experts" not in build_server_args(
        InferenceConfig(model="m"), "/m", on_cpu=False
    )
    cpu = build_server_args(cfg, "/models/m", on_cpu=True)
    assert "--enable-return-routed-experts" not in cpu  # vLLM's needs its GPU-only Model Runner V2
    assert "--no-enable-prefix-caching" in cpu and "--enforce-eager" not in cpu  # compiled, as by default
    assert server_env(cfg, on_cpu=True)[RECORD_ROUTING_ENV] == "1"
    assert server_env(InferenceConfig(model="m"), on_cpu=True)[RECORD_ROUTING_ENV] == "0"
    assert RECORD_ROUTING_ENV not in server_env(cfg, on_cpu=False)


def test_routed_experts_on_a_cpu_engine_refuse_prefix_caching_naming_why() -> None:
    from grpo.utils.errors import UserError

    cfg = InferenceConfig(model="m", return_routed_experts=True, enable_prefix_caching=True)
    with pytest.raises(UserError, match="a prefix-cache hit forwards none of its prompt"):
        build_server_args(cfg, "/models/m", on_cpu=True)


@pytest.mark.parametrize(
    ("fields", "on_cpu", "expected"),
    [
        ({}, True, True),  # merged LoRA serving: vLLM-CPU compiles the base model
        ({}, False, True),
        ({"enforce_eager": True}, True, False),
        ({"enforce_eager": True}, False, False),
        ({"lora_serving": "adapter"}, True, False),  # vLLM-CPU runs a LoRA engine eagerly
        ({"lora_serving": "adapter"}, False, True),
    ],
)
def test_engine_runs_compiled_unless_eager_or_serving_adapters_on_cpu(
    fields: dict[str, object], on_cpu: bool, expected: bool
) -> None:
    cfg = InferenceConfig.model_validate({"model": "m", **fields})
    assert engine_runs_compiled(cfg, on_cpu=on_cpu) is expected


def test_the_server_fetches_no_remote_or_local_media_but_takes_data_urls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import base64
    import io

    from PIL import Image
    from vllm.multimodal.media import MediaConnector

    from grpo.inference.vllm_compat.version import parse_server_args

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = parse_server_args(build_server_args(InferenceConfig(model="m"), "/models/m", on_cpu=True))
    connector = MediaConnector(
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
    )
    for url in ("http://169.254.169.254/latest/meta-data", "https://example.com/cat.png"):
        with pytest.raises(ValueError, match="allowed domains"):
            connector.fetch_image(url)
    with pytest.raises(RuntimeError, match="allowed-local-media-path"):
        connector.fetch_image("file:///etc/passwd")
    buffer = io.BytesIO()
    Image.new("RGB", (3, 2), "red").save(buffer, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert connector.fetch_image(data_url).size == (3, 2)
