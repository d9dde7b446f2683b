"""Building and serving vLLM's OpenAI app: only the routes grpo uses kept, the API key required on
all of them but /health, prompt inputs grpo does not send refused (grpo.inference.media_guard),
grpo's routes added, the bound port and engine client handed back, the server run in a non-main
thread, LoRA adapter loads checked and made one-shot."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from grpo.inference.api_key_guard import ApiKeyGuard
from grpo.inference.media_guard import MediaGuard
from grpo.inference.vllm_compat.engine_process import (
    end_engine_with_its_parent,
    give_the_engine_time_to_tear_down,
)
from grpo.utils.ports import HELD_PORT_ENV

LoraPathCheck = Callable[[str], tuple[str, None] | tuple[None, str]]
"""An adapter path -> (the resolved path to load, None) or (None, why it is refused)."""

SERVED_VLLM_PATHS = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/load_lora_adapter",
        "/inference/v1/generate",
    }
)
"""vLLM's routes a grpo server keeps: what grpo's client, supervisor and recovery use (liveness,
Prometheus metrics, the model list, token-id completions, adapter hot-loads, the token-in route
that takes prompts with images: grpo.inference.generate_bodies), and chat completions,
the one route people point their own tools at to look at the policy being trained (an
OpenAI-compatible client, a judge). vLLM 0.32 adds many more (responses, messages, tokenize,
/invocations, SageMaker's /adapters, /load, /version, the docs, elastic-EP scaling, ...); none is
used by a run, so none is served."""

OnReady = Callable[[Any, int], None]
"""Called on the server's event loop once the engine is up, just before HTTP serving starts:
(engine_client, bound port). Poll /health to know when requests are answered."""


async def serve(
    args: argparse.Namespace,
    on_ready: OnReady | None = None,
    extend_app: Callable[[Any], None] | None = None,
    lora_path_check: LoraPathCheck | None = None,
) -> bool:
    """Run vLLM's OpenAI server until it shuts down; True if the engine died (errored).

    `extend_app(app)` adds routes (grpo's weight routes) before serving starts;
    `lora_path_check(path)` gives the path /v1/load_lora_adapter (and SageMaker's POST /adapters)
    loads instead of `path`, or why it must not load it (403). Adapters of the server's own
    --lora-modules load before it applies.

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
    # SO_REUSEPORT only on a port a supervisor holds for this server (grpo.utils.ports): elsewhere
    # it would let a second server of the same user share the port instead of failing to start.
    held_here = os.environ.get(HELD_PORT_ENV) == str(args.port)
    _listen_address, sock = launcher.setup_server(args, reuse_port=held_here)
    port = int(sock.getsockname()[1])
    # uvicorn serves the pre-bound socket; the port is only logged and used in messages.
    args.port = port
    engine_client: Any = None
    async with entry.build_async_engine_client(args) as client:
        engine_client = client
        supported_tasks = await engine_client.get_supported_tasks()
        app = build_app(args, supported_tasks, engine_client.model_config)
        keep_only_served_routes(app)
        refuse_unsent_inputs(app)
        require_api_key(app, args)
        if extend_app is not None:
            extend_app(app)
        await init_app_state(engine_client, app.state, args, supported_tasks)
        # Per server, not per process: tests (and a replica pool in one process) run several
        # servers side by side, each with its own weight_dirs.
        app.state.openai_serving_models.grpo_lora_path_check = lora_path_check
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


def keep_only_served_routes(app: Any) -> list[str]:
    """Drop every route of vLLM's `app` outside SERVED_VLLM_PATHS (before grpo adds its own);
    returns the paths dropped."""
    kept = [route for route in app.router.routes if getattr(route, "path", None) in SERVED_VLLM_PATHS]
    dropped = sorted({str(getattr(route, "path", route)) for route in app.router.routes} - SERVED_VLLM_PATHS)
    app.router.routes[:] = kept
    return dropped


def refuse_unsent_inputs(app: Any) -> None:
    """Answer 400 to prompts carrying images in a form grpo does not send, or tensors
    (grpo.inference.media_guard). Wrapped before the API key guard, which then runs first."""
    app.middleware_stack = MediaGuard(app.middleware_stack or app.build_middleware_stack())


def require_api_key(app: Any, args: argparse.Namespace) -> bool:
    """Guard every route of `app` but /health with the API key vLLM would use (--api-key, else
    $VLLM_API_KEY), if there is one; whether there is. vLLM's own check covers only /v1 and a few
    other prefixes."""
    import vllm.envs as envs

    from grpo.utils.auth import check_secret

    keys = [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]
    for key in keys:
        check_secret(key, "the inference server's API key (--api-key or $VLLM_API_KEY)")
    if keys:
        # Outside everything: build_app has already built the middleware stack (SageMaker's
        # bootstrap), so add_middleware is closed; the built stack is wrapped instead.
        app.middleware_stack = ApiKeyGuard(app.middleware_stack or app.build_middleware_stack(), keys)
    return bool(keys)


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


def reset_inplace_flag_after_lora_load() -> None:
    """Check adapter paths with the server's `grpo_lora_path_check` (set by `serve` on its
    OpenAIServingModels): a refused path gets 403, an accepted one is loaded from the resolved path
    the check returned (not the one the client sent, which a link could redirect after the check);
    after an in-place adapter load, store the adapter's request with load_inplace=False.

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
        path_check: LoraPathCheck | None = getattr(self, "grpo_lora_path_check", None)
        if path_check is not None:
            resolved, refusal = path_check(request.lora_path)
            if resolved is None:
                from vllm.entrypoints.serve import create_error_response

                return create_error_response(refusal, err_type="Forbidden", status_code=HTTPStatus.FORBIDDEN)
            request = request.model_copy(update={"lora_path": resolved})
        result = await original(self, request, base_model_name)
        # No await between the original storing the request and this replacement, so no
        # request can pick up the flagged copy.
        stored = self.lora_requests.get(request.lora_name)
        if stored is not None and stored.load_inplace:
            self.lora_requests[request.lora_name] = msgspec.structs.replace(stored, load_inplace=False)
        return result

    OpenAIServingModels.load_lora_adapter = load_lora_adapter
    _lora_patch_applied = True


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
