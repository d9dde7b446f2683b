"""Data-parallel training over several processes (torchrun): init, batch sharing, balancing, reduction.

Only rank 0 talks to the orchestrator: it receives each batch and sends it to the other ranks as
plain tensors (an int64 header, then the per-token arrays), never pickled objects. Every rank then
holds the whole batch, computes the same balanced split of its rows and trains on its share. While
rank 0 waits for a batch, the other ranks wait outside any collective (grpo.trainer.rank_zero_gate),
so the process group's timeout (`dist_timeout`) bounds collectives, never that wait.

The loss of every rank is already divided by the loss tokens of the whole step (all ranks), so the
step gradient is the SUM of the ranks' gradients, never their mean.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np

from grpo.trainer.rank_zero_gate import RankZeroGate
from grpo.transport.batches.batch import (
    KEPT_COUNTS_DTYPE,
    OPTIONAL_ROW_FIELDS,
    ROUTING_DTYPES,
    ROW_FIELDS,
    PackedRow,
    SamplingTruncation,
    TrainingBatch,
)

if TYPE_CHECKING:
    import torch

# Header layout: [step, num_rows, has_teacher, top_k, top_p bits, min_p bits, routing layers,
# routing top_k, routing dtype (index in ROUTING_DTYPES + 1; 0: no routing), row_len_0, ...];
# num_rows -1 means stop.
_HEADER_FIXED = 9
_STOP = -1
_INT_FIELDS = [name for name, dtype in ROW_FIELDS.items() if np.dtype(dtype).kind in "iub"]
_FLOAT_FIELDS = [name for name, dtype in ROW_FIELDS.items() if np.dtype(dtype).kind == "f"]
_INT_DTYPES = {**{name: ROW_FIELDS[name] for name in _INT_FIELDS}, "kept_counts": KEPT_COUNTS_DTYPE}


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    """The device this rank trains on (cuda:LOCAL_RANK, or cpu)."""
    gate: RankZeroGate
    """Where ranks > 0 wait for rank 0 before a collective it may reach late (the process group's)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_gate: RankZeroGate | None = None
"""The gates of the process group init_distributed created (one per process)."""


def init_distributed(device_type: str, timeout_s: float) -> DistContext | None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
    None for a single process. nccl on CUDA, gloo on CPU. A collective fails after `timeout_s`
    seconds without every rank; the first call in a process creates the group (later ones join it)."""
    global _gate
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # The rendezvous init_process_group would do itself, done here to keep its store for the gates.
        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            store=dist.PrefixStore("default_pg", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        _gate = RankZeroGate(dist.PrefixStore("grpo_gates", store), rank, world_size)
    assert _gate is not None, "the trainer's process group is created by init_distributed only"
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device, gate=_gate)


def balance_rows(rows: list[PackedRow], world_size: int) -> list[list[PackedRow]]:
    """Split rows over ranks: every rank gets the same number of rows (padding with `empty_row`s
    that carry no loss), and greedily about the same number of tokens. Deterministic: every rank
    computes it (see `balance_row_indices`)."""
    from grpo.trainer.packing import empty_row

    shares = balance_row_indices([r.num_tokens for r in rows], world_size)
    return [[rows[i] if i < len(rows) else empty_row() for i in share] for share in shares]


def balance_row_indices(row_lengths: list[int], world_size: int) -> list[list[int]]:
    """Row indices per rank, the same count on every rank; an index >= len(row_lengths) is a padding
    row (`empty_row`). Largest rows first, each to the rank with the fewest tokens
    that still has room; batch order kept inside each share (a 1-rank run and rank-local work
    look alike)."""
    from grpo.trainer.packing import empty_row

    num_per_rank = max(1, -(-len(row_lengths) // world_size))
    num_padding = num_per_rank * world_size - len(row_lengths)
    lengths = row_lengths + [empty_row().num_tokens] * num_padding
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shares: list[list[int]] = [[] for _ in range(world_size)]
    tokens = [0] * world_size
    for index in order:
        open_ranks = [r for r in range(world_size) if len(shares[r]) < num_per_rank]
        target = min(open_ranks, key=lambda r: (tokens[r], r))
        shares[target].append(index)
        tokens[target] += lengths[index]
    return [sorted(share) for share in shares]


def _send_or_receive(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    import torch.distributed as dist

    on_device = tensor.to(ctx.device)
    dist.broadcast(on_device, src=0)
    return on_device.cpu()


def share_batch(batch: TrainingBatch | None, ctx: DistContext) -> TrainingBatch | None:
    """Rank 0 passes its batch (None = stop), the others pass None; all get rank 0's batch back
    (metadata stays on rank 0: it is only logged there). Ranks > 0 wait for rank 0 to have it
    outside the collective, however long it waits for the orchestrator."""
    import torch

    ctx.gate.pass_gate("the next batch")
    if ctx.is_main:
        header = _header(batch)
        size = torch.tensor([len(header)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    size = _send_or_receive(size, ctx)
    header_t = (
        torch.tensor(header, dtype=torch.int64) if ctx.is_main else torch.zeros(int(size), dtype=torch.int64)
    )
    header = _send_or_receive(header_t, ctx).tolist()
    step, num_rows, optional_bits, top_k, *truncation_bits, num_layers, routing_top_k, routing_dtype = header[
        :_HEADER_FIXED
    ]
    has_teacher, has_kept_counts = bool(optional_bits & 1), bool(optional_bits & 2)
    if num_rows == _STOP:
        return None
    row_lengths = header[_HEADER_FIXED:]
    float_fields = _FLOAT_FIELDS + (list(OPTIONAL_ROW_FIELDS) if has_teacher else [])
    int_fields = _INT_FIELDS + (["kept_counts"] if has_kept_counts else [])
    num_tokens = sum(row_lengths)
    if ctx.is_main:
        assert batch is not None
        ints = torch.from_numpy(np.stack([_cat(batch, f).astype(np.int64) for f in int_fields]))
        floats = torch.from_numpy(np.stack([_cat(batch, f).astype(np.float32) for f in float_fields]))
    else:
        ints = torch.zeros(len(int_fields), num_tokens, dtype=torch.int64)
        floats = torch.zeros(len(float_fields), num_tokens, dtype=torch.float32)
    ints = _send_or_receive(ints, ctx)
    floats = _send_or_receive(floats, ctx)
    routing = None
    if routing_dtype:  # the rows' routed experts, for routing replay on every rank
        assert batch is not None or not ctx.is_main
        routing = _send_or_receive(
            torch.from_numpy(_cat_routing(batch))
            if ctx.is_main and batch is not None
            else torch.zeros(num_tokens, num_layers, routing_top_k, dtype=torch.int64),
            ctx,
        )
    if ctx.is_main:
        return batch
    columns = {name: ints[i].numpy().astype(_INT_DTYPES[name]) for i, name in enumerate(int_fields)}
    columns.update({name: floats[i].numpy() for i, name in enumerate(float_fields)})
    bounds = np.cumsum([0, *row_lengths])
    if routing is not None:
        columns["routed_experts"] = routing.numpy().astype(ROUTING_DTYPES[routing_dtype - 1])
    rows = [
        PackedRow(**{name: column[bounds[i] : bounds[i + 1]].copy() for name, column in columns.items()})
        for i in range(len(row_lengths))
    ]
    top_p, min_p = np.array(truncation_bits, dtype=np.int64).view(np.float64).tolist()
    return TrainingBatch(step=step, rows=rows, sampling=SamplingTruncation(top_k, top_p, min_p))


def _header(batch: TrainingBatch | None) -> list[int]:
    """[step, rows, optional fields (1: teacher logprobs, 2: kept counts), top_k, top_p and min_p as
    float64 bits, routing layers, top_k and dtype, each row's tokens...]."""
    if batch is None:
        return [0, _STOP, 0, 0, 0, 0, 0, 0, 0]
    has_teacher = bool(batch.rows) and batch.rows[0].teacher_logprobs is not None
    sampling = batch.sampling
    truncation_bits = np.array([sampling.top_p, sampling.min_p], dtype=np.float64).view(np.int64).tolist()
    has_kept_counts = any(r.kept_counts is not None for r in batch.rows)
    optional_bits = int(has_teacher) | int(has_kept_counts) << 1
    fixed = [batch.step, len(batch.rows), optional_bits, sampling.top_k, *truncation_bits]
    return [*fixed, *_routing_header(batch), *(r.num_tokens for r in batch.rows)]


def _routing_header(batch: TrainingBatch) -> list[int]:
    """[layers, top_k, dtype index + 1] of the rows' routed experts when every row has them (one
    shape and dtype, as the engine records them), else [0, 0, 0]."""
    routings = [r.routed_experts for r in batch.rows]
    if not routings or any(routing is None for routing in routings):
        return [0, 0, 0]
    first = routings[0]
    assert first is not None
    assert all(r is not None and r.shape[1:] == first.shape[1:] and r.dtype == first.dtype for r in routings)
    return [first.shape[1], first.shape[2], ROUTING_DTYPES.index(first.dtype) + 1]


def _cat_routing(batch: TrainingBatch) -> np.ndarray:
    return np.concatenate([r.routed_experts for r in batch.rows if r.routed_experts is not None]).astype(
        np.int64
    )


def _cat(batch: TrainingBatch, name: str) -> np.ndarray:
    if name == "kept_counts":  # a row without counts sends 0s: the rules decide there, as without
        return np.concatenate(
            [
                r.kept_counts if r.kept_counts is not None else np.zeros(r.num_tokens, np.int32)
                for r in batch.rows
            ]
        )
    dtype = {**ROW_FIELDS, **OPTIONAL_ROW_FIELDS}[name]
    return np.concatenate([getattr(r, name) for r in batch.rows]) if batch.rows else np.zeros(0, dtype)


def sum_floats(values: list[float], ctx: DistContext) -> list[float]:
    """Element-wise sum of `values` over ranks (metrics: loss sums, token counts)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.cpu().tolist()]


def broadcast_int(value: int, ctx: DistContext) -> int:
    """Rank 0's `value` on every rank (the others pass anything)."""
    import torch

    return int(_send_or_receive(torch.tensor([value], dtype=torch.int64), ctx).item())


def barrier(ctx: DistContext) -> None:
    import torch.distributed as dist

    dist.barrier(device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)


def gather_bytes(data: bytes, ctx: DistContext) -> list[bytes]:
    """Every rank's `data`, by rank, on every rank (raw bytes over the collective: nothing unpickled)."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(data)], dtype=torch.int64, device=ctx.device)
    sizes = [torch.zeros_like(size) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, size)
    max_size = max(int(s.item()) for s in sizes)
    padded = torch.zeros(max_size, dtype=torch.uint8)
    if data:  # frombuffer refuses an empty buffer
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros(max_size, dtype=torch.uint8, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, padded.to(ctx.device))
    return [bytes(g.cpu()[: int(s.item())].numpy()) for g, s in zip(gathered, sizes, strict=True)]


def sum_tensor(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Element-wise sum over ranks, returned on CPU."""
    import torch.distributed as dist

    on_device = tensor.to(ctx.device)
    dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
    return on_device.cpu()


def same_on_every_rank(values: list[int], ctx: DistContext) -> bool:
    """Whether every rank passed the same `values` (of the same length on every rank)."""
    import torch
    import torch.distributed as dist

    low = torch.tensor(values, dtype=torch.int64, device=ctx.device)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))
