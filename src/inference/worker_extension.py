"""Methods grafted onto vLLM's worker (worker_extension_cls), called through collective_rpc.

vLLM imports this module inside the engine's worker process before the model loads, which is
where the CPU dense-weight patch has to happen. Results go back through vLLM's RPC, so they
are plain JSON-able data (no tensors, nothing pickled by us).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.inference.vllm_compat import (
    cpu_block_size,
    cpu_float32_head,
    cpu_seeded_sampling,
    cpu_weights,
    kept_counts,
    routing_capture,
)
from grpo.inference.weight_handles import export_record
from grpo.transport.weights.collective import DEFAULT_SECRET_ENV

if TYPE_CHECKING:
    import torch


# Set for every CPU engine (and co-located GPU ones, where each of these returns at once or patches
# only CPU code paths).
if os.environ.get(cpu_weights.KEEP_DENSE_WEIGHTS_ENV) == "1":
    cpu_weights.keep_dense_cpu_weights()
    cpu_weights.keep_dense_cpu_experts()
    cpu_weights.keep_row_major_cpu_fp8_weights()
    cpu_seeded_sampling.seeded_requests_survive_chunked_prefill()
    cpu_float32_head.keep_float32_cpu_head()
    cpu_block_size.allow_16_token_cpu_blocks()
if os.environ.get(routing_capture.RECORD_ROUTING_ENV) == "1":
    routing_capture.record_routing_on_load()
if os.environ.get(kept_counts.RECORD_KEPT_COUNTS_ENV) == "1":
    kept_counts.record_kept_counts_on_load()


def hf_checkpoint_shapes(hf_config: Any, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in the state dict of the causal LM `hf_config` describes:
    the names and shapes a trainer's full weights carry. Built on the meta device, so nothing is
    allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _rebuild_derived_weights(model: torch.nn.Module) -> None:
    """After `model.load_weights`: the CPU kernels' copies of the weights (packed linears, the float32
    head) are made again from the updated parameters."""
    cpu_weights.repack_cpu_linear_weights(model)
    cpu_float32_head.forget_float32_heads(model)


class WorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    model_config: Any
    """vLLM's ModelConfig of the served model (set by vLLM's worker)."""

    def _grpo_model(self) -> torch.nn.Module:
        return cpu_weights.worker_model(self)

    def load_weights_from_path(self, path: str) -> int:
        """Load a folder of HF-named safetensors into the model; returns the number of tensors."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}; publish full weights as safetensors")
        model = self._grpo_model()
        cpu_weights.refuse_full_updates_of_packed_experts(model)
        num_tensors = 0
        for file in files:
            tensors = load_file(str(file))
            num_tensors += len(tensors)
            model.load_weights(weights=iter(tensors.items()))
        _rebuild_derived_weights(model)
        return num_tensors

    def _grpo_hf_config(self) -> tuple[Any, bool]:
        return cpu_weights.worker_hf_config(self)

    def _grpo_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of the served model's checkpoint tensors (worked out once)."""
        shapes: dict[str, tuple[int, ...]] | None = getattr(self, "_grpo_shapes", None)
        if shapes is None:
            shapes = self._grpo_shapes = hf_checkpoint_shapes(*self._grpo_hf_config())
        return shapes

    def receive_weights_collective(
        self,
        host: str,
        port: int,
        timeout: float,
        version: int,
        rank: int = 1,
        world_size: int = 2,
        secret_env: str = DEFAULT_SECRET_ENV,
    ) -> int:
        """Receive policy `version`'s full weights from the trainer at host:port and load them.

        This worker is `rank` of `world_size` (the trainer is rank 0, each inference server one
        rank; the orchestrator assigns them). It proves, and checks the trainer proves, the secret
        in `$secret_env` (the variable is read here, in the server's environment), and takes only
        tensors the served model has, in its shapes. Returns the number of tensors loaded, 0 when
        this worker already runs `version` or newer (a restarted orchestrator asks again for the
        version it last saw). One collective session per version (docs/multi_node.md);
        TimeoutError naming the missing ranks after `timeout` s.
        """
        from grpo.transport.weights.collective import CollectiveWeightReceiver

        if version <= getattr(self, "_grpo_collective_version", 0):
            return 0
        model = self._grpo_model()
        cpu_weights.refuse_full_updates_of_packed_experts(model)  # before the trainer's session opens
        expected = self._grpo_checkpoint_shapes()
        serving_dtype = str(self.model_config.dtype).removeprefix("torch.")
        receiver = CollectiveWeightReceiver(
            host, port, timeout, rank=rank, world_size=world_size, secret_env=secret_env,
            serving_dtype=serving_dtype,
        )  # fmt: skip
        num_tensors = 0
        try:
            step, buckets = receiver.receive_buckets(expected=expected)
            if step != version:
                raise ValueError(
                    f"the trainer at {host}:{port} sent policy {step}, but policy {version} was announced; "
                    "is another trainer using the same weight_broadcast port?"
                )
            # One bucket in memory at a time: vLLM copies each into its parameters (fused ones by shard).
            for bucket in buckets:
                model.load_weights(weights=iter(bucket))
                num_tensors += len(bucket)
        finally:
            receiver.close()
        _rebuild_derived_weights(model)
        self._grpo_collective_version = version
        return num_tensors

    def merge_lora_from_path(self, path: str) -> int:
        """Serve base + the PEFT adapter in folder `path` (lora_serving: merged); returns the layers merged.

        Each merge starts from the dense base weights, which stay untouched (the co-located trainer
        borrows them): only the CPU kernels' packed copies change. So adapters never accumulate, and
        a layer the previous adapter changed but this one does not goes back to the base.
        """
        from grpo.inference.lora_merge import merge_plan, merged_weight

        layers = cpu_weights.linear_layers(self._grpo_model())
        plan = merge_plan(path, {name: sizes for name, (_layer, sizes) in layers.items()})
        previous: set[str] = getattr(self, "_grpo_merged_layers", set())
        for name in previous - plan.keys():
            layer = layers[name][0]
            cpu_weights.pack_cpu_linear_weight(layer, layer.weight)
        for name, updates in plan.items():
            layer = layers[name][0]
            cpu_weights.pack_cpu_linear_weight(layer, merged_weight(layer.weight, updates))
        self._grpo_merged_layers = set(plan)
        return len(plan)

    def unmerge_lora(self) -> int:
        """Serve the base weights again (undo merge_lora_from_path); returns the layers restored."""
        layers = cpu_weights.linear_layers(self._grpo_model())
        merged: set[str] = getattr(self, "_grpo_merged_layers", set())
        for name in merged:
            layer = layers[name][0]
            cpu_weights.pack_cpu_linear_weight(layer, layer.weight)
        self._grpo_merged_layers = set()
        return len(merged)

    def apply_noisy_norms(self, path: str) -> int:
        """QeRL: copy RMSNorm weights from a safetensors file (HF names) into the model."""
        from safetensors.torch import load_file

        norms = load_file(path)
        non_norm = [name for name in norms if "norm" not in name]
        if non_norm:
            raise ValueError(
                f"{path} holds non-norm tensors {non_norm[:3]}; noisy norms hold RMSNorm weights only"
            )
        self._grpo_model().load_weights(weights=iter(norms.items()))
        return len(norms)

    def export_weight_handles(self) -> list[dict[str, Any]]:
        """Share every parameter with another process: one JSON-able record per parameter.

        See grpo.inference.weight_handles (rebuild_tensor is the receiving side). Keep the
        engine awake (no sleep mode, no offload) while another process holds these.
        """
        return [
            export_record(name, param)
            for name, param in self._grpo_model().named_parameters()
            # An empty parameter is a linear weight the CPU packer dropped (GRPO_KEEP_DENSE_WEIGHTS unset).
            if param.numel() > 0
        ]

    def take_routed_experts(self, request_ids: list[str], num_positions: list[int]) -> list[str | None]:
        """The recorded routing of each engine request `request_ids[i]` (the id vLLM was given,
        without the suffix it adds), [num_positions[i], layers, top_k] as base64 `.npy`
        (grpo.inference.completion_bodies.encode_routed_experts), forgotten here; None for a request
        this worker did not run or a server that does not record (RECORD_ROUTING_ENV unset)."""
        from grpo.inference.completion_bodies import encode_routed_experts

        recorder = getattr(self.model_runner, "grpo_routing", None)  # type: ignore[attr-defined]
        if recorder is None:
            return [None] * len(request_ids)
        taken = [recorder.take_matching(r, n) for r, n in zip(request_ids, num_positions, strict=True)]
        return [None if routing is None else encode_routed_experts(routing) for routing in taken]

    def take_kept_counts(
        self, request_ids: list[str], starts: list[int], num_tokens: list[int]
    ) -> list[list[int] | None]:
        """The kept-set sizes the sampler recorded for engine request `request_ids[i]` (the id vLLM
        was given, without the suffix it adds) at positions starts[i] .. starts[i] + num_tokens[i] - 1
        (0 where none), forgotten here; None for a request this worker did not run or a server that
        does not record (RECORD_KEPT_COUNTS_ENV unset)."""
        recorder = getattr(self.model_runner, "grpo_kept_counts", None)  # type: ignore[attr-defined]
        if recorder is None:
            return [None] * len(request_ids)
        return [
            recorder.take_matching(r, start, n)
            for r, start, n in zip(request_ids, starts, num_tokens, strict=True)
        ]
