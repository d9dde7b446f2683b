"""InferenceConfig -> vLLM OpenAI-server argv and environment.

Pure functions (no vLLM import), so every key's mapping is unit-tested without an engine.
"""

from __future__ import annotations

import json
import math
import os
from typing import Literal

from grpo.config.inference import InferenceConfig
from grpo.config.machine.engine_dtype import merging_is_exact, resolve_engine_dtype
from grpo.inference.vllm_compat.cpu_block_size import CPU_BLOCK_SIZE_UNIT
from grpo.inference.vllm_compat.cpu_weights import KEEP_DENSE_WEIGHTS_ENV
from grpo.inference.vllm_compat.kept_counts import RECORD_KEPT_COUNTS_ENV
from grpo.inference.vllm_compat.routing_capture import RECORD_ROUTING_ENV
from grpo.inference.vllm_compat.version import WORKER_EXTENSION_CLS
from grpo.utils.auth import secret_from_env
from grpo.utils.errors import UserError

DEFAULT_CPU_KV_CACHE_GB = 2


LoraServing = Literal["adapter", "merged"]


def resolve_lora_serving(cfg: InferenceConfig, on_cpu: bool | None = None) -> LoraServing:
    """The LoRA serving mode `cfg` runs with on this machine (`lora_serving` with auto decided).

    auto merges on CPU, where vLLM's LoRA path is about 3x slower than the base model
    (benchmarks/results/inference_cpu-2core_embedded.json), and keeps adapters on GPU, where the
    LoRA kernels are fast and merging would need a second copy of the base. A quantized,
    tensor-parallel or 16-bit engine cannot merge exactly (grpo.config.machine.engine_dtype.merging_is_exact),
    so auto serves adapters there.
    """
    if cfg.lora_serving == "adapter":
        return "adapter"
    if on_cpu is None:
        on_cpu = not _cuda_available()
    if cfg.lora_serving == "merged":
        if not on_cpu:
            raise UserError(
                "lora_serving merged is implemented for vLLM's CPU backend only (on GPU the served weights "
                "are the borrowed base); set lora_serving to adapter (or auto) in the inference config"
            )
        if not merging_is_exact(cfg, on_cuda=False):
            raise UserError(
                f"lora_serving merged with dtype {cfg.dtype} on CPU: a 16-bit merged weight drops the LoRA "
                "updates smaller than its rounding step, so the engine would sample an older policy than the "
                "one trained; set dtype: float32 (or auto) in the inference config, or lora_serving: adapter"
            )
        return "merged"
    exact = on_cpu and cfg.tp == 1 and cfg.quantization is None and merging_is_exact(cfg, on_cuda=False)
    return "merged" if exact else "adapter"


def engine_runs_compiled(cfg: InferenceConfig, on_cpu: bool | None = None) -> bool:
    """Whether vLLM runs the model compiled (torch.compile; its default) for `cfg`: not with
    `enforce_eager`, nor on CPU when it serves LoRA adapters (vLLM-CPU then runs eagerly)."""
    if cfg.enforce_eager:
        return False
    if on_cpu is None:
        on_cpu = not _cuda_available()
    return not (on_cpu and cfg.enable_lora and resolve_lora_serving(cfg, on_cpu) == "adapter")


def resolve_block_size(cfg: InferenceConfig, on_cpu: bool) -> int | None:
    """The KV-cache block size to ask of vLLM; None leaves vLLM's own (GPU).

    On CPU vLLM's default is 128 tokens, and prefix caching shares whole blocks only: the n
    completions of a shorter prompt, scheduled in the same step, each prefilled all of it (64
    completions of a 44-token prompt prefilled 2,824 tokens; with 32-token blocks 776, and the
    generation took 8.4 s instead of 12.3 s on 2 AVX2 cores). grpo's CPU default is the smallest
    block vLLM's CPU kernels take (default_cpu_block_size).
    """
    if cfg.block_size is None:
        return default_cpu_block_size() if on_cpu else None
    if on_cpu and cfg.block_size % CPU_BLOCK_SIZE_UNIT:
        raise UserError(
            f"block_size {cfg.block_size}: vLLM's CPU attention takes KV-cache blocks of a multiple of "
            f"{CPU_BLOCK_SIZE_UNIT} tokens; set block_size to {CPU_BLOCK_SIZE_UNIT} (or leave it unset) in the "
            "inference config"
        )
    return cfg.block_size


def default_cpu_block_size() -> int:
    """16 tokens (grpo.inference.vllm_compat.cpu_block_size), or 32 on a CPU with AMX, whose
    attention kernel vLLM picks only for a multiple of 32 (and 16-token blocks would give up)."""
    import torch

    return 32 if torch.cpu._is_amx_tile_supported() else CPU_BLOCK_SIZE_UNIT


NO_MEDIA_DOMAIN = "remote-media-disabled.invalid"
"""The one domain the server may fetch images from: `.invalid` names nothing (RFC 2606)."""


def build_server_args(cfg: InferenceConfig, model_path: str, on_cpu: bool | None = None) -> list[str]:
    """vLLM server argv for `cfg`, serving the weights at `model_path` under the name `cfg.model`.

    `on_cpu` (None: detect) decides `lora_serving: auto`."""
    if cfg.enable_auto_tool_choice and not cfg.tool_call_parser:
        raise UserError(
            "enable_auto_tool_choice needs tool_call_parser; set tool_call_parser (e.g. 'hermes') "
            "in the inference config, or turn enable_auto_tool_choice off"
        )
    if on_cpu is None:
        on_cpu = not _cuda_available()
    if cfg.return_routed_experts and on_cpu and cfg.enable_prefix_caching:
        raise UserError(
            "return_routed_experts on a CPU engine records routing only for the tokens each request forwards "
            "itself, and a prefix-cache hit forwards none of its prompt; set enable_prefix_caching: false "
            "(or leave it unset)"
        )
    argv = [
        "--model", model_path,
        "--served-model-name", cfg.model,
        "--host", cfg.bind_host,
        "--port", str(cfg.port),
        "--dtype", resolve_engine_dtype(cfg, on_cuda=not on_cpu),
        "--tensor-parallel-size", str(cfg.tp),
        "--data-parallel-size", str(cfg.dp),
        "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
        "--seed", str(cfg.seed),
        "--worker-extension-cls", WORKER_EXTENSION_CLS,
        # Logprobs after every sampling processor (the temperature: requests turn every other one
        # off), i.e. of the distribution tokens were sampled from.
        "--logprobs-mode", "processed_logprobs",
        # vLLM's neutral sampling defaults, not the checkpoint's generation_config.json (Qwen3:
        # top_k 20, top_p 0.95), for any request that leaves a setting out; grpo's state them all.
        "--generation-config", "vllm",
        # the token-in route /inference/v1/generate, the one that takes images with token ids
        "--enable-scale-out",
        # On CPU grpo records the routing itself (grpo.inference.routing_responses): vLLM's own
        # option needs its GPU-only Model Runner V2.
        *(["--enable-return-routed-experts"] if cfg.return_routed_experts and not on_cpu else []),
    ]  # fmt: skip
    if cfg.max_model_len is not None:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.max_logprobs != 20:  # vLLM's default
        argv += ["--max-logprobs", str(cfg.max_logprobs)]
    if cfg.quantization is not None:
        argv += ["--quantization", cfg.quantization]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    # Merged serving needs none of vLLM's LoRA machinery: the engine runs as the base model.
    if cfg.enable_lora and resolve_lora_serving(cfg, on_cpu) == "adapter":
        argv += [
            "--enable-lora",
            "--max-lora-rank", str(cfg.served_lora_rank),
            "--max-loras", str(cfg.max_loras),
            "--max-cpu-loras", str(max(cfg.max_cpu_loras, cfg.max_loras)),
        ]  # fmt: skip
    if cfg.return_routed_experts and on_cpu:
        argv.append("--no-enable-prefix-caching")
    elif cfg.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching")
    if cfg.reasoning_parser:
        argv += ["--reasoning-parser", cfg.reasoning_parser]
    if cfg.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    if cfg.tool_call_parser:
        argv += ["--tool-call-parser", cfg.tool_call_parser]
    # float32 logits from the 16-bit lm_head (no rounding to bf16: a bf16 logit of 10-30 is off by up
    # to 1/16), as the trainer computes them (grpo.trainer.float32_logits.float32_logits); a no-op for a
    # float32 model.
    overrides: dict[str, object] = {"head_dtype": "float32"}
    if cfg.rope_scaling:
        # vLLM >= 0.32 (transformers 5) reads RoPE settings from `rope_parameters`; dict
        # overrides merge into the model's own, so rope_theta is kept.
        overrides["rope_parameters"] = cfg.rope_scaling
    argv += ["--hf-overrides", json.dumps(overrides)]
    if cfg.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(cfg.max_num_seqs)]
    block_size = resolve_block_size(cfg, on_cpu)
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    # grpo sends images only as data: URLs; an http(s) image_url would make the server fetch it (a
    # request forgery from the inference host), so no domain is allowed. Local files stay refused too
    # (vLLM's allowed_local_media_path is left empty).
    argv += ["--allowed-media-domains", NO_MEDIA_DOMAIN]
    api_key = secret_from_env(cfg.api_key_var)
    if api_key is not None:
        argv += ["--api-key", api_key.decode()]
    return argv


def server_env(cfg: InferenceConfig, on_cpu: bool | None = None) -> dict[str, str]:
    """Environment variables the engine needs for `cfg` (set before the engine starts)."""
    if on_cpu is None:
        on_cpu = not _cuda_available()
    env: dict[str, str] = {}
    if cfg.enable_lora and resolve_lora_serving(cfg, on_cpu) == "adapter":
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if not on_cpu and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
        # A forked engine cannot use CUDA once anything in this process has touched it (vLLM forks
        # unless CUDA is fully initialised here); spawn is safe whatever ran before (grpo.utils.device).
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if on_cpu:
        # vLLM takes whole GiB.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(math.ceil(cfg.kv_cache_space_gb or DEFAULT_CPU_KV_CACHE_GB))
        # Full-weight updates and weight borrowing need the dense linear weights.
        env[KEEP_DENSE_WEIGHTS_ENV] = "1"
        # vLLM pins its OpenMP threads to cores by default; beside a trainer or a second engine on the
        # same few cores that starves one of them for minutes. A user's own setting wins.
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        # vLLM-CPU 0.32 with its torch 2.13 saves an AOT-compiled model it cannot load back ("'function'
        # object has no attribute 'finalize_loading'") and so compiles anew at every start (~14 s for
        # a 2-layer model here); its older cache path (traced again, inductor kernels loaded from disk)
        # starts a cached model in a few seconds with the same kernels. A user's own setting wins.
        if "VLLM_USE_AOT_COMPILE" not in os.environ:
            env["VLLM_USE_AOT_COMPILE"] = "0"
        # Stated either way: a second server started by the same process must not inherit it.
        env[RECORD_ROUTING_ENV] = "1" if cfg.return_routed_experts else "0"
    # The size of the set each token was sampled from, for the trainer's truncation; the hook is
    # the CPU sampler's. Stated either way, as above.
    env[RECORD_KEPT_COUNTS_ENV] = "1" if on_cpu else "0"
    return env


def _cuda_available() -> bool:
    from grpo.utils.device import cuda_present

    return cuda_present()
