"""Megatron policy -> HF-named full weights -> the existing weight transports.

Each parameter's tensor-parallel parts are all-gathered over the tensor-parallel group and merged
(grpo.trainer.megatron.convert.tp_merge); with expert parallelism each routed expert's weights are
all-gathered over the expert-parallel group (every rank's local expert j, renamed to its global
number); with pipeline stages, each later stage of rank 0's
pipeline sends its merged tensors to rank 0 (point to point, a JSON header of names, shapes and
dtypes first). Rank 0 renames them to HF names (global layer numbers) and writes them. The
filesystem transport gets an HF model folder: size-bounded safetensors files (at most
BUCKET_BYTES each, with HF's index file when there are several: vLLM's update route loads one file
at a time, so its transient memory is one bucket) and the checkpoint's config.json; the collective transport gets the tensors
themselves (grpo.trainer.hf.publish.publish_over_collective's sender).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.trainer.megatron.convert import is_expert_name, is_hf_norm, megatron_to_hf, tp_merge

if TYPE_CHECKING:
    import torch

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.megatron.model import MegatronModel

BUCKET_BYTES = 512 * 1024**2


def whole_megatron_state_dict(model: MegatronModel) -> dict[str, torch.Tensor]:
    """Every parameter of this pipeline stage under its whole-model name, tensor-parallel parts
    merged (collective over the tensor-parallel group; every rank of the group gets the whole
    tensors). A later stage's copy of the tied embedding is left out: the first stage holds it.
    With expert parallelism also collective over the expert-parallel group: every rank gets every
    expert."""
    import torch
    from megatron.core import parallel_state

    names = model.local_names()
    out = {}
    for local, param in model.module.named_parameters():
        if model.is_tied_copy(param):
            continue
        tensor = param.detach()
        if model.ranks.tp_size > 1:
            parts = [torch.empty_like(tensor) for _ in range(model.ranks.tp_size)]
            torch.distributed.all_gather(
                parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
            )
            tensor = tp_merge(names[local], parts)
        if model.ranks.ep_size > 1 and is_expert_name(local):
            out.update(_gather_experts(model, local, tensor))
        else:
            out[names[local]] = tensor
    return out


def _gather_experts(model: MegatronModel, local: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Local expert `local`'s tensor of every expert-parallel rank, by global name (collective
    over the expert-parallel group; every rank holds the same number of experts of one shape)."""
    import torch
    from megatron.core import parallel_state

    parts = [torch.empty_like(tensor) for _ in range(model.ranks.ep_size)]
    torch.distributed.all_gather(
        parts, tensor.contiguous(), group=parallel_state.get_expert_model_parallel_group()
    )
    return {model.global_name(local, ep_rank=rank): part for rank, part in enumerate(parts)}


def _send_stage(tensors: dict[str, torch.Tensor], main_rank: int, group: Any) -> None:
    """Send a stage's tensors to `main_rank`: first their names, shapes and dtypes as JSON (no
    pickles cross processes), then each tensor."""
    import torch

    header = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()]
    encoded = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    torch.distributed.send(torch.tensor([encoded.numel()], dtype=torch.int64), main_rank, group)
    torch.distributed.send(encoded, main_rank, group)
    for tensor in tensors.values():
        torch.distributed.send(tensor.contiguous(), main_rank, group)


def _receive_stage(source_rank: int, group: Any) -> dict[str, torch.Tensor]:
    import torch

    size = torch.zeros(1, dtype=torch.int64)
    torch.distributed.recv(size, source_rank, group)
    encoded = torch.empty(int(size), dtype=torch.uint8)
    torch.distributed.recv(encoded, source_rank, group)
    out = {}
    for name, shape, dtype in json.loads(bytes(encoded.tolist()).decode()):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        torch.distributed.recv(tensor, source_rank, group)
        out[name] = tensor
    return out


def gather_stages(stage: dict[str, torch.Tensor], model: MegatronModel) -> dict[str, torch.Tensor] | None:
    """Every pipeline stage's whole tensors on the main rank (global rank 0: the first stage of the
    first tensor- and data-parallel replica), in stage order; None elsewhere (collective). The other
    stages of the main rank's pipeline send theirs; the other replicas hold copies and send nothing."""
    import torch
    from megatron.core import parallel_state

    if model.ranks.pp_size == 1:
        return stage if torch.distributed.get_rank() == 0 else None
    if model.ranks.tp_rank != 0 or model.ranks.dp_rank != 0:
        return None
    group = parallel_state.get_pipeline_model_parallel_group()
    stage_ranks = torch.distributed.get_process_group_ranks(group)
    if not model.ranks.is_first_stage:
        _send_stage(stage, stage_ranks[0], group)
        return None
    out = dict(stage)
    for source in stage_ranks[1:]:
        out.update(_receive_stage(source, group))
    return out


def gather_hf_state_dict(model: MegatronModel, is_main: bool) -> dict[str, torch.Tensor] | None:
    """The whole policy under HF names on the main rank, None on the others (collective)."""
    whole = gather_stages(whole_megatron_state_dict(model), model)
    if whole is None:
        return None
    assert is_main, "the main rank is global rank 0"
    return {name: t.contiguous() for name, t in megatron_to_hf(whole, model.shape, model.norms).items()}


def buckets(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a larger tensor alone)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        num_bytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + num_bytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += num_bytes
    return groups


def write_hf_folder(
    tensors: dict[str, torch.Tensor], model_path: Path, folder: Path, max_bytes: int = BUCKET_BYTES
) -> None:
    """HF-named safetensors in size-bounded files, and the checkpoint's config.json, into `folder`."""
    from safetensors.torch import save_file

    groups = buckets(tensors, max_bytes)
    if len(groups) == 1:
        save_file(groups[0], str(folder / "model.safetensors"), {"format": "pt"})
    else:
        weight_map = {}
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(group, str(folder / file), {"format": "pt"})
            weight_map.update(dict.fromkeys(group, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    shutil.copy2(model_path / "config.json", folder / "config.json")


def publish_full_weights(
    tensors: dict[str, torch.Tensor],
    model_path: Path,
    cfg: TrainerConfig,
    run_dir: Path,
    version: int,
    over_collective: bool,
) -> Path:
    """Write (or announce and send) policy `version` as grpo.trainer.publish does for the HF backend."""
    from grpo.transport.weights.filesystem import broadcast_dir
    from grpo.utils.atomic import prune_stable, publish_dir, staging_dir

    if over_collective:
        from grpo.trainer.publish import send_over_collective

        return send_over_collective(list(tensors.items()), cfg, run_dir, version)
    final = broadcast_dir(run_dir, version)
    staged = staging_dir(final)
    write_hf_folder(tensors, model_path, staged)
    if cfg.noise_scheduler.enabled:
        from grpo.trainer.noise import write_noisy_norms

        # Norms are replicated over tensor-parallel ranks; drawn here, once, every server gets one noise.
        write_noisy_norms({n: t for n, t in tensors.items() if is_hf_norm(n)}, cfg, version, staged)
    publish_dir(staged, final)
    prune_stable(final.parent, keep=cfg.max_async_level + 1)
    return final
