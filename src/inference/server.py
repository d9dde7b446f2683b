"""Start vLLM's OpenAI server from Python: as the whole process (`grpo-infer`) or as a
background thread of a process that also trains (co-located mode).

Either way the engine runs in its own subprocess(es); the API server's event loop runs here.
Stopping always ends every engine process this server started, so nothing is orphaned.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any

from grpo.config.inference import InferenceConfig
from grpo.inference.server_args import build_server_args, resolve_lora_serving, server_env
from grpo.inference.vllm_compat import app as vllm_app
from grpo.inference.vllm_compat.cpu_block_size import allow_16_token_cpu_blocks
from grpo.inference.vllm_compat.version import check_vllm_version, parse_server_args
from grpo.inference.vllm_compat.vision_models import refuse_unservable_vision_model
from grpo.inference.weight_routes import WeightRouteRules, add_weight_routes
from grpo.utils.logging import get_logger
from grpo.utils.signals import interrupt_on_sigterm

log = get_logger("inference")

CHILD_EXIT_GRACE_S = 5.0


def prepare_server(cfg: InferenceConfig, model_path: str) -> tuple[argparse.Namespace, WeightRouteRules]:
    """Check vLLM, set the engine's environment, and parse the server argv for `cfg`; also what
    its weight routes accept (the LoRA serving mode with auto decided, the weight folders)."""
    version = check_vllm_version()
    allow_16_token_cpu_blocks()  # the engine config checks the block size in this process
    refuse_unservable_vision_model(model_path)
    lora_serving = resolve_lora_serving(cfg)
    os.environ.update(server_env(cfg))
    log.info("vLLM %s; serving %s from %s", version, cfg.model, model_path)
    if cfg.enable_lora:
        log.info(
            "LoRA serving: %s (lora_serving %s)%s",
            lora_serving,
            cfg.lora_serving,
            "; each new adapter is merged into the served weights, requests run as the base model"
            if lora_serving == "merged"
            else "; adapters are applied per request by vLLM's LoRA path",
        )
    rules = WeightRouteRules.for_config(cfg, lora_serving)
    log.info("weight routes load only from %s", ", ".join(str(d) for d in rules.weight_dirs))
    argv = build_server_args(cfg, model_path)
    _log_cpu_dtype(cfg, argv[argv.index("--dtype") + 1])
    return parse_server_args(argv), rules


def _log_cpu_dtype(cfg: InferenceConfig, engine_dtype: str) -> None:
    """Say why a CPU engine computes in float32 by default, or warn that a 16-bit one is emulated."""
    from grpo.utils.device import cpu_has_native_bf16, cuda_present

    if cuda_present():
        return
    native_bf16 = cpu_has_native_bf16()
    if cfg.dtype == "auto" and engine_dtype == "float32":  # quantized weights keep vLLM's auto
        log.info(
            "dtype auto: float32 on CPU (trainer and engine logprobs agree to ~1e-8, and a merged LoRA "
            "policy keeps every update%s); set dtype: bfloat16 to force 16 bits",
            ""
            if native_bf16
            else "; this CPU has no native 16-bit matmul, AVX512-BF16 or AMX, so bfloat16 "
            "would also run ~80x slower",
        )
    elif engine_dtype in ("bfloat16", "float16") and not native_bf16:
        log.warning(
            "dtype %s on a CPU without native 16-bit matmul (no AVX512-BF16 or AMX): every matmul is "
            "emulated, ~80x slower than float32; set dtype: auto (float32 here)",
            engine_dtype,
        )


async def serve_with_weight_routes(
    args: argparse.Namespace, rules: WeightRouteRules, on_ready: vllm_app.OnReady
) -> bool:
    """vLLM's server with grpo's weight routes, each accepting what `rules` allow; on a CPU engine
    that records routing or kept counts (server_env), completion responses carry them
    (grpo.inference.routing_responses)."""
    from grpo.inference.vllm_compat.kept_counts import RECORD_KEPT_COUNTS_ENV
    from grpo.inference.vllm_compat.routing_capture import RECORD_ROUTING_ENV

    def extend_app(app: Any) -> None:
        add_weight_routes(app, rules)
        routing = os.environ.get(RECORD_ROUTING_ENV) == "1"
        kept_counts = os.environ.get(RECORD_KEPT_COUNTS_ENV) == "1"
        if routing or kept_counts:
            from grpo.inference.routing_responses import RoutingResponses

            # Outside the built stack, as require_api_key wraps it (add_middleware is closed by now).
            app.middleware_stack = RoutingResponses(
                app.middleware_stack or app.build_middleware_stack(), routing=routing, kept_counts=kept_counts
            )

    return await vllm_app.serve(
        args, on_ready=on_ready, extend_app=extend_app, lora_path_check=rules.resolve_allowed
    )


def run_server(cfg: InferenceConfig) -> int:
    """Serve until Ctrl-C/SIGTERM (returns 0) or until the engine dies (returns 1). Blocking."""
    from grpo.models.resolve import resolve_model

    resolved = resolve_model(cfg.model)
    log.info(resolved.describe())
    args, rules = prepare_server(cfg, str(resolved.path))

    # Until vLLM's server installs its own handlers, SIGTERM interrupts start-up like Ctrl-C.
    interrupt_on_sigterm()

    def _on_ready(_engine_client: Any, port: int) -> None:
        log.info("inference server listening on http://%s:%d/v1", cfg.bind_host, port)

    exit_code = 0
    try:
        engine_died = asyncio.run(serve_with_weight_routes(args, rules, _on_ready))
        if engine_died:
            log.error("the inference engine process died; see its traceback above")
            exit_code = 1
    except KeyboardInterrupt as interrupt:
        log.info("interrupted (%s) during start-up", interrupt or "SIGINT")
    finally:
        num_left = end_processes(_children())
        log.info(
            "inference server stopped (exit code %d)%s",
            exit_code,
            f"; ended {num_left} leftover engine process(es)" if num_left else "; no engine process left",
        )
    return exit_code


class ServerThread:
    """vLLM's API server on a background thread of this process, engine in its subprocess."""

    def __init__(self, cfg: InferenceConfig, model_path: str, quiet: bool = False) -> None:
        """`quiet`: no uvicorn start-up lines, no access-log line per request, no weight-loading
        progress bar (a co-located run, whose console is for training progress)."""
        self.cfg = cfg
        self.model_path = model_path
        self.quiet = quiet
        self.engine_client: Any = None
        """vLLM's EngineClient (AsyncLLM); use only through `collective_rpc` or on `self.loop`."""
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._engine_up = threading.Event()
        self._error: BaseException | None = None
        self._signal_handlers: dict[int, Any] = {}
        self._children_before: set[int] = set()
        self.engine_died = False
        self.rules = WeightRouteRules()
        """What its weight routes accept (set by start(); `rules.lora_serving` is how it takes an adapter)."""

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server has no port yet; call start() and wait_ready() first")
        return f"http://{self.cfg.bind_host}:{self.port}/v1"

    def start(self) -> ServerThread:
        args, self.rules = prepare_server(self.cfg, self.model_path)
        if self.quiet:
            args.uvicorn_log_level, args.disable_uvicorn_access_log = "warning", True
            args.use_tqdm_on_load = False
        self._children_before = {p.pid for p in _children()}
        self.loop = asyncio.new_event_loop()
        self._signal_handlers = vllm_app.allow_server_in_thread(self.loop)
        self._thread = threading.Thread(target=self._run, args=(args,), name="grpo-vllm-server", daemon=True)
        self._thread.start()
        return self

    def _run(self, args: argparse.Namespace) -> None:
        assert self.loop is not None
        asyncio.set_event_loop(self.loop)
        try:
            self.engine_died = self.loop.run_until_complete(
                serve_with_weight_routes(args, self.rules, self._on_ready)
            )
        except BaseException as error:  # reported to the owner thread by wait_ready/stop
            self._error = error
        finally:
            self.loop.close()
            self._engine_up.set()

    def _on_ready(self, engine_client: Any, port: int) -> None:
        self.engine_client = engine_client
        self.port = port
        self._engine_up.set()

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until the server answers /health; raise if it failed or took longer than `timeout`."""
        import httpx

        deadline = time.monotonic() + timeout
        if not self._engine_up.wait(timeout):
            raise TimeoutError(f"vLLM engine not up after {timeout:.0f} s")
        while True:
            self._raise_if_failed()
            try:
                if (
                    httpx.get(f"http://{self.cfg.bind_host}:{self.port}/health", timeout=2.0).status_code
                    == 200
                ):
                    log.info("inference server (thread) ready at %s", self.base_url)
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM server on port {self.port} not answering /health after {timeout:.0f} s"
                )
            time.sleep(0.2)

    def is_running(self) -> bool:
        """True while the server thread serves and the engine has not died."""
        return self._thread is not None and self._thread.is_alive() and not self.engine_died

    def _raise_if_failed(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError(
                f"the vLLM server thread exited (engine died: {self.engine_died})"
            ) from self._error

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), timeout: float | None = None
    ) -> list[Any]:
        """Call a WorkerExtension method on every worker; one result per worker."""
        if self.engine_client is None or self.loop is None:
            raise RuntimeError("the engine is not up; call start() and wait_ready() first")
        future = asyncio.run_coroutine_threadsafe(
            self.engine_client.collective_rpc(method, timeout=timeout, args=args), self.loop
        )
        return list(future.result(timeout))

    def stop(self, timeout: float = 60.0) -> None:
        """Shut the server and engine down; no engine process survives this call."""
        thread, loop = self._thread, self.loop
        # Stopping the engine makes vLLM's output handler log an "EngineDeadError" traceback; after a
        # deliberate stop that is noise, not news.
        logging.getLogger("vllm").setLevel(logging.CRITICAL)
        if thread is not None and thread.is_alive() and loop is not None:
            trigger = self._signal_handlers.get(signal.SIGTERM)
            if trigger is not None:
                loop.call_soon_threadsafe(trigger)
            else:  # still starting up: HTTP serving (and its handler) not there yet
                loop.call_soon_threadsafe(_cancel_all_tasks)
            thread.join(timeout)
        if thread is not None and not thread.is_alive():
            # vLLM has shut the engine down; an AsyncLLM still referenced here would be collected
            # only at interpreter exit, where its __del__ calls a module global already torn down
            # ("Exception ignored in AsyncLLM.__del__ ... TypeError").
            self.engine_client = None
        leftovers = [p for p in _children() if p.pid not in self._children_before]
        num_left = end_processes(leftovers)
        log.info(
            "inference server thread stopped%s",
            f"; ended {num_left} leftover process(es)" if num_left else "",
        )


def _cancel_all_tasks() -> None:
    for task in asyncio.all_tasks():
        task.cancel()


def _children() -> list[Any]:
    """This process's descendants, except multiprocessing's resource tracker (it ignores SIGTERM
    and exits with this process; ending it early would break later multiprocessing use)."""
    from multiprocessing import resource_tracker

    import psutil

    tracker_pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return [p for p in psutil.Process().children(recursive=True) if p.pid != tracker_pid]


def end_processes(processes: list[Any], grace_s: float = CHILD_EXIT_GRACE_S) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, every process still running; returns how many were."""
    import psutil

    alive = [p for p in processes if p.is_running()]
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _gone, stubborn = psutil.wait_procs(alive, timeout=grace_s)
    for process in stubborn:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(stubborn, timeout=grace_s)
    return len(alive)
