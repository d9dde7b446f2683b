"""The engine worker's model, and the CPU GEMM kernels' weight layout: dense weights (linears, and
the experts of MoE layers) kept beside their packed copies (updatable, borrowable), linears
repacked after an update."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KEEP_DENSE_WEIGHTS_ENV = "GRPO_KEEP_DENSE_WEIGHTS"
"""Set to 1 in the engine's environment to keep dense linear weights as parameters on CPU."""


def worker_model(worker: Any) -> torch.nn.Module:
    """The nn.Module a vLLM worker runs."""
    model: torch.nn.Module = worker.model_runner.model
    return model


def worker_hf_config(worker: Any) -> tuple[Any, bool]:
    """The transformers config of the model a vLLM worker serves, and whether the engine trusts
    the model folder's code (needed to build a model of that config)."""
    model_config = worker.model_config
    return model_config.hf_config, bool(model_config.trust_remote_code)


def keep_dense_cpu_weights() -> None:
    """On CPU, keep each dense linear weight as a parameter next to its packed copy.

    vLLM's CPU backend repacks linear weights for oneDNN and replaces the parameter with an
    empty tensor; weight updates and weight borrowing need the dense parameter. linear.py
    imports the dispatch function from its module at call time, so wrapping it there suffices.
    Must run in the engine worker before the model loads (the worker extension does it).
    """
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "_grpo_keeps_weights", False):
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        original(layer, remove_weight=False)

    dispatch_keeping_weight._grpo_keeps_weights = True  # type: ignore[attr-defined]
    dispatch_keeping_weight._grpo_original = original  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


DENSE_EXPERT_PARAMS = {"w13_weight": "w13_weight_dense", "w2_weight": "w2_weight_dense"}
"""A fused-MoE layer's expert weights -> the name its dense copy is kept under on CPU."""


def keep_dense_cpu_experts() -> None:
    """On CPU, keep each unquantized MoE layer's expert weights dense next to their packed copies.

    vLLM's CPU experts (CPUUnquantizedExperts and its x86/Arm/Power kinds) zero-pad the expert
    intermediate size to their kernel's alignment and replace `w13_weight` [E, 2 x I, H] (gate rows
    then up rows per expert) and `w2_weight` [E, H, I] by a grouped-GEMM prepacked copy of the same
    shape, a layout only that kernel reads. The tensors as loaded are kept alive as the parameters
    `w13_weight_dense` / `w2_weight_dense` (no copy: the kernel's packed tensors are the new ones),
    which the co-located trainer borrows. Must run in the engine worker before the model loads.
    Idempotent.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # GPU experts keep the loaded layout (docs/colocate.md)
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    original = CPUUnquantizedExperts.process_weights_after_loading
    if getattr(original, "_grpo_keeps_experts", False):
        return

    def process_keeping_dense(experts: Any, layer: torch.nn.Module) -> None:
        loaded = {name: getattr(layer, name) for name in DENSE_EXPERT_PARAMS}
        original(experts, layer)
        for name, dense_name in DENSE_EXPERT_PARAMS.items():
            if getattr(layer, name) is not loaded[name]:  # replaced by a packed (or padded) copy
                layer.register_parameter(
                    dense_name, torch.nn.Parameter(loaded[name].data, requires_grad=False)
                )

    process_keeping_dense._grpo_keeps_experts = True  # type: ignore[attr-defined]
    CPUUnquantizedExperts.process_weights_after_loading = process_keeping_dense


def refuse_full_updates_of_packed_experts(model: torch.nn.Module) -> None:
    """ValueError when `model` has CPU-packed experts: a full-weight update would be loaded past the
    kernel's packed copy (keep_dense_cpu_experts), which nothing rebuilds, so the engine would keep
    sampling from the old experts or fail on the packed shape."""
    for name, _ in model.named_parameters():
        if name.endswith(tuple(DENSE_EXPERT_PARAMS.values())):
            raise ValueError(
                "full-weight updates of a mixture-of-experts model on vLLM's CPU engine are not supported (its "
                "expert kernel computes with a packed copy grpo does not rebuild); train with LoRA (lora: true) "
                "or serve the model on a GPU"
            )


def keep_row_major_cpu_fp8_weights() -> None:
    """On CPU, keep FP8 block-quantized linear weights in their [out, in] layout (borrowable).

    vLLM's AMX FP8 kernel (CPUFp8BlockScaledMMKernel) VNNI-packs each weight after loading, a
    layout only that kernel reads. A layer flagged `_cpu_skip_gemm_dispatch` (vLLM's own flag,
    set for MLA's kv_b_proj) keeps the checkpoint layout and the kernel packs on the fly, so the
    trainer can borrow the FP8 codes and scales. Idempotent; a no-op where the kernel is absent.
    """
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    except ImportError:  # not a vLLM build with the CPU FP8 kernel: nothing to keep
        return
    original = CPUFp8BlockScaledMMKernel.process_weights_after_loading
    if getattr(original, "_grpo_keeps_layout", False):
        return

    def process_keeping_layout(kernel: Any, layer: torch.nn.Module) -> None:
        layer._cpu_skip_gemm_dispatch = True
        original(kernel, layer)

    process_keeping_layout._grpo_keeps_layout = True  # type: ignore[attr-defined]
    CPUFp8BlockScaledMMKernel.process_weights_after_loading = process_keeping_layout


def repack_cpu_linear_weights(model: torch.nn.Module) -> int:
    """Rebuild the CPU GEMM kernels' packed copies from the (updated) dense weights.

    Returns the number of layers repacked. A no-op off CPU (no layer has `cpu_linear`).
    """
    from vllm.model_executor.layers import utils

    dispatch = getattr(
        utils.dispatch_cpu_unquantized_gemm, "_grpo_original", utils.dispatch_cpu_unquantized_gemm
    )
    num_repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or weight is None or weight.ndim != 2:
            continue
        if weight.numel() == 0:
            raise RuntimeError(
                "the engine dropped its dense linear weights (vLLM CPU default); start it with "
                f"{KEEP_DENSE_WEIGHTS_ENV}=1 (grpo's server_env sets it on CPU) to update weights"
            )
        dispatch(module, remove_weight=False)
        num_repacked += 1
    return num_repacked


def linear_layers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, list[int]]]:
    """The CPU-packed linear layers: name (without LoRA's `.base_layer`) -> (layer, output sizes).

    Output sizes are the fused parts' rows ([q, k, v] for qkv_proj, [gate, up] for gate_up_proj),
    or [out] for an unfused layer (tp 1: a layer holds every row).
    """
    layers: dict[str, tuple[torch.nn.Module, list[int]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or weight is None or weight.ndim != 2:
            continue
        sizes = list(getattr(module, "output_sizes", None) or [weight.shape[0]])
        if sum(sizes) != weight.shape[0]:
            raise RuntimeError(f"{name}: output sizes {sizes} do not add up to its {weight.shape[0]} rows")
        layers[name.removesuffix(".base_layer")] = (module, sizes)
    return layers


def pack_cpu_linear_weight(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """Make `layer` compute with `weight` (not its own `weight` parameter, which stays untouched).

    The CPU GEMM dispatch builds the kernel (a oneDNN / sgl packed copy) from a layer's `weight`;
    here it runs on a stand-in holding `weight`, so the dense parameter the co-located trainer
    borrows is never written. Kernels that read the weight passed at call time (the torch
    fallback) get `weight` bound, since vLLM passes the layer's own parameter.
    """
    import torch
    from vllm.model_executor.layers import utils

    dispatch = getattr(
        utils.dispatch_cpu_unquantized_gemm, "_grpo_original", utils.dispatch_cpu_unquantized_gemm
    )
    if weight is layer.weight:
        dispatch(layer, remove_weight=False)
        return
    stand_in = torch.nn.Module()
    stand_in.weight = torch.nn.Parameter(weight, requires_grad=False)
    stand_in.bias = getattr(layer, "bias", None)  # the sgl kernel casts the (shared) bias once
    dispatch(stand_in, remove_weight=False)
    kernel = stand_in.cpu_linear
    probe = torch.randn(2, weight.shape[1], dtype=weight.dtype)
    reads_weight_argument = not torch.equal(
        kernel(probe, weight, None), kernel(probe, torch.zeros_like(weight), None)
    )
    if reads_weight_argument:
        layer.cpu_linear = lambda x, _weight, bias: kernel(x, weight, bias)
    else:
        layer.cpu_linear = kernel
