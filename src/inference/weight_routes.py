"""grpo's own HTTP routes on the vLLM server: how the orchestrator changes the served policy.

With an API key, the server requires it on them as on every route but /health
(grpo.inference.api_key_guard; a server bound off loopback must have a key: grpo.config.inference). Behind the key, two rules keep any client to
what a run needs:
- every path a route loads (full weights, an adapter, noisy norms, and vLLM's own
  /v1/load_lora_adapter) must lie inside the server's weight_dirs, symlinks resolved, so no request
  makes the engine read files the run did not write; the path is resolved once and the resolved
  path is what the workers load, so a link swapped after the check changes nothing; / is never a
  weight dir;
- the collective route exists only on a server started for weight_broadcast_type nccl, so no client
  can point a filesystem-mode server at a store of its choosing, and it waits for the trainer at
  most the server's own weight_receive_timeout_s (a request may ask for less, never more).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.inference.vllm_compat.app import serve_name_as_base_model
from grpo.utils.errors import UserError

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    from grpo.config.inference import InferenceConfig

UPDATE_WEIGHTS_ROUTE = "/v1/grpo/update_weights"
"""POST {"path": folder of safetensors}: load full weights on every worker, then reset the prefix cache."""

RECEIVE_WEIGHTS_ROUTE = "/v1/grpo/receive_weights"
"""POST {"host", "port", "version", "rank", "world_size", "timeout"}: the server's worker joins the
trainer's collective as `rank` of `world_size` (trainer = rank 0; optional, default 1 of 2),
proving the secret in the server's weight_secret_env, and receives full weights checked against
the served model's shapes (docs/multi_node.md), then the prefix cache is reset. 424 with the
reason when the transfer fails (a missing trainer times out after the server's
weight_receive_timeout_s, or the request's optional `timeout` in seconds when that is shorter)."""

MERGE_LORA_ROUTE = "/v1/grpo/merge_lora"
"""POST {"lora_name", "lora_path"}: merge the PEFT adapter in lora_path into the served weights (from
the untouched base), reset the prefix cache, and serve `lora_name` as another name of the base
model (requests naming it run without a LoRA request). 424 with the reason when the merge fails."""

LORA_SERVING_ROUTE = "/v1/grpo/lora_serving"
"""GET: {"lora_serving": "adapter" | "merged"}, how this server takes a new adapter (404 on a plain
vLLM server: adapters, through /v1/load_lora_adapter)."""

APPLY_NOISY_NORMS_ROUTE = "/v1/grpo/apply_noisy_norms"
"""POST {"path": safetensors file}: copy QeRL noisy RMSNorm weights into the model."""


@dataclass(frozen=True)
class WeightRouteRules:
    """What the weight routes of one server accept."""

    lora_serving: str = "adapter"
    """What LORA_SERVING_ROUTE answers: "adapter" or "merged"."""
    weight_dirs: tuple[Path, ...] = ()
    """Resolved folders whose files the routes may load; empty: none."""
    collective: bool = False
    """Whether RECEIVE_WEIGHTS_ROUTE exists (weight_broadcast_type nccl)."""
    weight_secret_env: str = "GRPO_WEIGHTS_SECRET"
    """Variable holding the collective's secret; the worker reads it itself, only the name travels."""
    receive_timeout_s: float = 1200.0
    """Longest wait of RECEIVE_WEIGHTS_ROUTE for the trainer (infer weight_receive_timeout_s)."""

    @classmethod
    def for_config(cls, cfg: InferenceConfig, lora_serving: str) -> WeightRouteRules:
        """The rules of a server started with `cfg` (relative weight_dirs read from the working
        directory now); UserError when a weight dir is / (it would admit every file)."""
        dirs = cfg.weight_dirs if cfg.weight_dirs is not None else [os.getcwd()]
        weight_dirs = tuple(Path(d).resolve() for d in dirs)
        for given, folder in zip(dirs, weight_dirs, strict=True):
            if folder == Path(folder.anchor):
                where = (
                    f"infer weight_dirs lists {given!r}"
                    if cfg.weight_dirs is not None
                    else "infer weight_dirs is null and the server's working directory is /"
                )
                raise UserError(
                    f"{where}: the weight routes would load every file of the machine; set infer "
                    "weight_dirs to the folder holding the orchestrator's output_dir (or start the server "
                    "from that folder)"
                )
        return cls(
            lora_serving=lora_serving,
            weight_dirs=weight_dirs,
            collective=cfg.weight_broadcast_type == "nccl",
            weight_secret_env=cfg.weight_secret_env,
            receive_timeout_s=cfg.weight_receive_timeout_s,
        )

    def resolve_allowed(self, path: str) -> tuple[str, None] | tuple[None, str]:
        """(`path` resolved, None) when it lies inside a weight dir: the path to load, so the check
        and the load see the same file even if a link on the way is changed in between; else
        (None, why the routes must not load it, one line with the fix)."""
        resolved = Path(path).resolve()
        if any(resolved.is_relative_to(folder) for folder in self.weight_dirs):
            return str(resolved), None
        allowed = ", ".join(str(folder) for folder in self.weight_dirs) or "none"
        return None, (
            f"{path} is outside this server's weight_dirs ({allowed}); start the server with the "
            "orchestrator's output_dir inside infer weight_dirs (they are read relative to the server's "
            "working directory)"
        )

    def path_refusal(self, path: str) -> str | None:
        """Why the routes must not load `path` (one line with the fix), or None."""
        return self.resolve_allowed(path)[1]


def add_weight_routes(app: Any, rules: WeightRouteRules) -> None:
    """Add the routes above to vLLM's app, each accepting what `rules` allow."""
    from starlette.responses import JSONResponse

    def _route(rpc_method: str) -> Callable[[Request], Any]:
        async def handle(request: Request) -> JSONResponse:
            body = await request.json()
            if not isinstance(body, dict) or not isinstance(body.get("path"), str):
                return JSONResponse({"error": 'body must be {"path": "<folder or file>"}'}, status_code=400)
            path, refusal = rules.resolve_allowed(body["path"])
            if path is None:
                return JSONResponse({"error": refusal}, status_code=403)
            engine = request.app.state.engine_client
            results = await engine.collective_rpc(rpc_method, args=(path,))
            # Cached prefixes were computed with the old weights.
            await engine.reset_prefix_cache()
            return JSONResponse({"results": results})

        return handle

    async def receive_weights(request: Request) -> JSONResponse:
        body = await request.json()
        fields: dict[str, type | tuple[type, ...]] = {"host": str, "port": int, "version": int}
        optional = {"rank": 1, "world_size": 2}
        asked = body.get("timeout", rules.receive_timeout_s) if isinstance(body, dict) else None
        if (
            not isinstance(body, dict)
            or not all(isinstance(body.get(k), t) for k, t in fields.items())
            or not all(isinstance(body.get(k, d), int) for k, d in optional.items())
            or isinstance(asked, bool)
            or not isinstance(asked, int | float)
            or not asked > 0  # NaN too
        ):
            return JSONResponse(
                {
                    "error": 'body must be {"host": str, "port": int, "version": int, "rank": int, '
                    '"world_size": int, "timeout": seconds > 0} (rank, world_size and timeout optional)'
                },
                status_code=400,
            )
        engine = request.app.state.engine_client
        args = (
            body["host"],
            body["port"],
            # The server's own limit: a request may shorten the wait, never lengthen it.
            float(min(asked, rules.receive_timeout_s)),
            body["version"],
            body.get("rank", 1),
            body.get("world_size", 2),
            rules.weight_secret_env,
        )
        try:
            results = await engine.collective_rpc("receive_weights_collective", args=args)
        except Exception as error:  # the reason goes back to the orchestrator instead of a bare 500
            return JSONResponse({"error": f"{type(error).__name__}: {error}"}, status_code=424)
        await engine.reset_prefix_cache()
        return JSONResponse({"results": results})

    async def merge_lora(request: Request) -> JSONResponse:
        body = await request.json()
        if not isinstance(body, dict) or not all(
            isinstance(body.get(k), str) for k in ("lora_name", "lora_path")
        ):
            return JSONResponse(
                {"error": 'body must be {"lora_name": str, "lora_path": str}'}, status_code=400
            )
        path, refusal = rules.resolve_allowed(body["lora_path"])
        if path is None:
            return JSONResponse({"error": refusal}, status_code=403)
        engine = request.app.state.engine_client
        try:
            results = await engine.collective_rpc("merge_lora_from_path", args=(path,))
        except Exception as error:  # the reason goes back to the orchestrator instead of a bare 500
            return JSONResponse({"error": f"{type(error).__name__}: {error}"}, status_code=424)
        # Cached prefixes were computed with the previous policy.
        await engine.reset_prefix_cache()
        serve_name_as_base_model(request.app.state, body["lora_name"])
        return JSONResponse({"results": results})

    async def get_lora_serving(_request: Request) -> JSONResponse:
        return JSONResponse({"lora_serving": rules.lora_serving})

    app.add_route(UPDATE_WEIGHTS_ROUTE, _route("load_weights_from_path"), methods=["POST"])
    # Also on an adapter-serving server (benchmarks and tests compare both paths on one engine).
    app.add_route(MERGE_LORA_ROUTE, merge_lora, methods=["POST"])
    app.add_route(LORA_SERVING_ROUTE, get_lora_serving, methods=["GET"])
    if rules.collective:
        app.add_route(RECEIVE_WEIGHTS_ROUTE, receive_weights, methods=["POST"])
    app.add_route(APPLY_NOISY_NORMS_ROUTE, _route("apply_noisy_norms"), methods=["POST"])
