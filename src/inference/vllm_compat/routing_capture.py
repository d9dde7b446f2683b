"""Record the experts vLLM-CPU's mixture-of-experts layers route each token to, per request.

vLLM 0.32 returns routing (`--enable-return-routed-experts`) only under its Model Runner V2, which
the CPU engine does not run. Its CPU router (`CPURouter`, a `BaseRouter`) still calls a capture
callback with the logical expert ids of every token it routes, [num_tokens, top_k], the hook vLLM's
own capturer binds; this module binds its own there and files each forward's ids under the
requests the tokens belong to (the V1 runner lays a step's tokens out request by request, in
`input_batch.req_ids` order, `query_start_loc` apart) at the tokens' positions.

Positions a request never forwarded itself carry no routing (NO_ROUTING): the prompt tokens a
prefix-cache hit skipped (grpo-infer turns prefix caching off while it records), and the last
sampled token. Bind the recorder as the model loads (record_routing_on_load), before vLLM compiles
it: so bound it records on the compiled engine as on the eager one, and replaying either's routing
lowers the trainer's mismatch (docs/moe.md); installed on a compiled engine already warmed up, it
recorded nothing (not investigated further). vLLM-CPU routes inside its MoE custom op, which
torch.compile leaves opaque.

grpo-infer records when RECORD_ROUTING_ENV is 1 in the engine's environment (the worker extension
patches the CPU model runner's load_model then); grpo.inference.routing_responses takes each
request's routing when its completion response leaves the server. A request never taken (a streamed
or failed one) is dropped once MAX_KEPT_REQUESTS newer ones are filed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

RECORD_ROUTING_ENV = "GRPO_RECORD_ROUTING"
"""Set to 1 in the engine's environment to record every request's routing (CPU engines)."""

MAX_KEPT_REQUESTS = 4096
"""Requests whose routing waits to be taken; the oldest is dropped past this."""


def engine_request_ids(response_id: str, n: int) -> list[str]:
    """The engine request id (before the random suffix vLLM adds) of each choice of the one-prompt
    completion `response_id` sampled `n` times, in choice order: vLLM 0.32's OpenAI server sends
    prompt i of completion `cmpl-X` as `cmpl-X-i`, and with n > 1 splits it into `j_cmpl-X-i`."""
    prompt = f"{response_id}-0"
    return [prompt] if n == 1 else [f"{i}_{prompt}" for i in range(n)]


@dataclass
class RoutingRecorder:
    """Routing of every request the engine ran since its last `take`, by engine request id."""

    num_layers: int
    """Decoder layers (routing is indexed by decoder layer, as vLLM's own capture indexes it)."""
    top_k: int
    num_experts: int
    _step: dict[int, torch.Tensor] = field(default_factory=dict)
    """Decoder layer -> [num_tokens, top_k] expert ids of the forward under way."""
    _requests: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    """Request id -> position -> [num_layers, top_k] expert ids (NO_ROUTING in dense layers)."""

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._step[layer] = topk_ids.detach().to("cpu", copy=True)

    def file_step(self, req_ids: list[str], query_start: np.ndarray, positions: torch.Tensor) -> None:
        """File the forward just run: request i owns tokens query_start[i]:query_start[i + 1]."""
        import numpy as np

        from grpo.transport.batches.batch import no_routing, routing_dtype

        step, self._step = self._step, {}
        if not step or not req_ids:
            return
        num_tokens = int(query_start[len(req_ids)])
        dtype = routing_dtype(self.num_experts)
        table = np.full((num_tokens, self.num_layers, self.top_k), no_routing(dtype), dtype=dtype)
        for layer, ids in step.items():
            table[:, layer] = ids[:num_tokens].numpy()
        where = positions[:num_tokens].tolist()
        for i, req_id in enumerate(req_ids):
            filed = self._requests.setdefault(req_id, {})
            for token in range(int(query_start[i]), int(query_start[i + 1])):
                filed[where[token]] = table[token]
        while len(self._requests) > MAX_KEPT_REQUESTS:
            del self._requests[next(iter(self._requests))]

    def take(self, req_id: str, num_positions: int) -> np.ndarray | None:
        """[num_positions, num_layers, top_k] routing of `req_id` (NO_ROUTING where none was
        recorded), forgotten here; None when the request routed nothing."""
        import numpy as np

        from grpo.transport.batches.batch import no_routing

        filed = self._requests.pop(req_id, None)
        if not filed:
            return None
        dtype = next(iter(filed.values())).dtype
        out = np.full((num_positions, self.num_layers, self.top_k), no_routing(dtype), dtype=dtype)
        for position, row in filed.items():
            if position < num_positions:
                out[position] = row
        return out

    def take_matching(self, external_id: str, num_positions: int) -> np.ndarray | None:
        """`take` for the request vLLM's engine knows as `external_id` plus its random suffix."""
        matches = [r for r in self._requests if r == external_id or r.startswith(f"{external_id}-")]
        assert len(matches) <= 1, f"request id {external_id} matches {matches}"
        return self.take(matches[0], num_positions) if matches else None


def install_routing_recorder(runner: Any) -> RoutingRecorder:
    """Bind a RoutingRecorder to every MoE router of a vLLM V1 model runner (`worker.model_runner`)
    and file each forward under its requests. ValueError for a model whose routers take no
    capture callback (a monolithic kernel routing inside itself)."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    model_config = runner.model_config
    if model_config.uses_mrope:
        raise ValueError(
            f"routing capture: {model_config.model} uses multimodal positions ([3, tokens]), which the "
            "recorder does not map to tokens; set return_routed_experts: false"
        )
    recorder = RoutingRecorder(
        num_layers=model_config.get_total_num_hidden_layers(),
        top_k=model_config.get_num_experts_per_tok(),
        num_experts=model_config.get_num_experts(),
    )
    num_bound = 0
    for module in runner.model.modules():
        if not isinstance(module, MoERunner):
            continue
        if not isinstance(module.router, BaseRouter):
            raise ValueError(
                f"routing capture: router {type(module.router).__name__} takes no capture callback"
            )
        module.router.set_capture_fn(partial(recorder.capture, module.layer_id))
        num_bound += 1
    if num_bound == 0:
        raise ValueError(
            f"routing capture: {model_config.model} has no mixture-of-experts layers vLLM routes"
        )
    forward = runner._model_forward

    def recording_forward(*args: Any, positions: torch.Tensor | None = None, **kwargs: Any) -> Any:
        out = forward(*args, positions=positions, **kwargs)
        num_reqs = runner.input_batch.num_reqs
        if positions is not None and num_reqs:
            recorder.file_step(
                list(runner.input_batch.req_ids[:num_reqs]),
                runner.query_start_loc.np[: num_reqs + 1],
                positions,
            )
        return out

    runner._model_forward = recording_forward
    return recorder


def record_routing_on_load() -> None:
    """Install a RoutingRecorder on every CPU model runner right after its model loads (kept on the
    runner as `grpo_routing`). Must run in the engine worker before the model loads (the worker
    extension does it). Idempotent."""
    from grpo.inference.vllm_compat.runner_load_hook import on_cpu_model_load

    on_cpu_model_load("grpo_routing", install_routing_recorder)
