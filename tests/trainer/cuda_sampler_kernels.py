"""vLLM 0.32's CUDA sampler kernels, transcribed to plain torch (float32, one row at a time), as the
reference the trainer's CUDA rules (grpo.trainer.cuda_sampling_truncation) are checked against on CPU.

Transcribed from reading vllm/v1/worker/gpu/sample/min_p.py (`_min_p_kernel`) and
vllm/v1/sample/ops/topk_topp_triton.py: the one-program-per-row kernel (`_topk_topp_kernel`, its
whole-row search branches; the outlier gathering only narrows where the same searches start) and
the split-row top_p pipeline (`_topp_sb_*`, one slice per row) that vLLM takes on CUDA for top_p
alone in batches of at most 64 sequences. Each search, its termination test, its iteration cap, its
1e-9 tolerances and its duplicate (tie) budget follow the kernel; sums are taken over the whole row
at once where the kernels sum tile by tile, and exp/log/division are torch's, not the GPU's
approximations, so only rounding at the last bit can differ.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
UINT32 = 2**32
TIE_TOLERANCE = 1e-9
MAX_SEARCH_ITERATIONS = 18
SPLIT_FANOUT = 8
SPLIT_ROUNDS = 5


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def min_p_kernel(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """[N, V] float32 -> a copy with min_p applied: -inf below max + log(min_p)."""
    if min_p == 0.0:
        return logits.clone()
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(f32(min_p))
    return torch.where(logits < threshold, NEG_INF, logits)


def _stats_above(values: torch.Tensor, pivot: torch.Tensor, sentinel: float) -> tuple[int, torch.Tensor, int]:
    """(number of values above pivot, the smallest of them, how many equal it within 1e-9)."""
    above = values > pivot
    smallest = values[above].min() if bool(above.any()) else f32(sentinel)
    num_smallest = int((above & ((values - smallest).abs() < TIE_TOLERANCE)).sum())
    return int(above.sum()), smallest, num_smallest


def _mass_above(probs: torch.Tensor, pivot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(mass above pivot, the smallest probability above it, how many equal it within 1e-9)."""
    above = probs > pivot
    _, smallest, num_smallest = _stats_above(probs, pivot, 1.0)
    return (probs * above).sum(), smallest, num_smallest


def _bisect_top_p(probs: torch.Tensor, p: torch.Tensor, low: torch.Tensor, high: torch.Tensor):
    """The kernel's top_p pivot search: (pivot, smallest probability above it, its count, mass)."""
    num_iterations = 0
    while True:
        pivot_0 = (high - low) * f32(0.5) + low
        mass_0, smallest_0, num_smallest_0 = _mass_above(probs, pivot_0)
        found = None
        if mass_0 >= p and mass_0 - smallest_0 * num_smallest_0 < p:
            found = (pivot_0, smallest_0, num_smallest_0, mass_0)
        if mass_0 > p:
            low = pivot_0
        elif mass_0 < p:
            high = pivot_0
        num_iterations += 1
        if (high - low) < TIE_TOLERANCE or num_iterations >= MAX_SEARCH_ITERATIONS:
            return (high + low) / f32(2.0), smallest_0, num_smallest_0, mass_0
        if found is not None:
            return found


def _num_to_keep(num_ties: int, mass: torch.Tensor, p: torch.Tensor, smallest: torch.Tensor) -> int:
    """num_ties - uint32((mass - p) / smallest), in the kernel's uint32 arithmetic (a negative float
    converts to 0)."""
    surplus = ((mass - p) / smallest).item()
    surplus = 0 if surplus != surplus else max(0, int(surplus))  # NaN converts to 0 too
    return (num_ties - surplus) % UINT32


def topk_topp_kernel(logits: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    """[N, V] float32 -> a copy with `_topk_topp_kernel`'s top_k and top_p applied to each row."""
    return torch.stack([_topk_topp_row(row, k, p) for row in logits])


def _topk_topp_row(row: torch.Tensor, k: int | None, p_value: float | None) -> torch.Tensor:
    num_vocab = row.shape[0]
    p = f32(p_value) if p_value is not None else None
    final_pivot = f32(NEG_INF)
    duplicate_logit = f32(float("inf"))
    num_duplicates, num_keep = 0, 0
    max_logit = f32(NEG_INF)
    finite = row > NEG_INF
    if k is not None and k < num_vocab:
        max_logit = row.max()
        min_logit = torch.minimum(row[finite].min() if bool(finite.any()) else f32(float("inf")), max_logit)
        num_finite = int(finite.sum())
        # ternary search for a pivot with >= k logits above it and < k above its next value
        low, high = min_logit, max_logit
        num_iterations = 0
        k_pivot, num_above_k_pivot = f32(float("inf")), 0
        smallest_above, num_smallest_above = f32(float("inf")), 0
        while True:
            pivot_0 = (high - low) * f32(1.0) / f32(3.0) + low
            pivot_1 = (high - low) * f32(2.0) / f32(3.0) + low
            num_0, smallest_0, ties_0 = _stats_above(row, pivot_0, float("inf"))
            num_1, smallest_1, ties_1 = _stats_above(row, pivot_1, float("inf"))
            found = False
            if num_0 >= k and num_0 - ties_0 < k:
                k_pivot, num_above_k_pivot, smallest_above, num_smallest_above = (
                    pivot_0,
                    num_0,
                    smallest_0,
                    ties_0,
                )
                found = True
            if num_1 >= k and num_1 - ties_1 < k:
                k_pivot, num_above_k_pivot, smallest_above, num_smallest_above = (
                    pivot_1,
                    num_1,
                    smallest_1,
                    ties_1,
                )
                found = True
            if num_1 > k:
                low = pivot_1
            elif num_0 > k:
                low = pivot_0
            if num_0 < k:
                high = pivot_0
            elif num_1 < k:
                high = pivot_1
            num_iterations += 1
            if num_iterations >= MAX_SEARCH_ITERATIONS or (low - high).abs() < TIE_TOLERANCE:
                k_pivot = (high + low) / f32(2.0)
                smallest_above, num_smallest_above = smallest_0, ties_0
                break
            if found:
                break
        duplicate_logit, num_duplicates = smallest_above, num_smallest_above
        num_keep = (num_duplicates - (num_above_k_pivot - k) % UINT32) % UINT32
        final_pivot = k_pivot if num_finite > k else f32(NEG_INF)
        if p is not None and num_finite > k and p < 1.0:
            # top_p over the logits above the top_k pivot, the surplus ties at the k-th dropped
            outlier = row > k_pivot
            is_duplicate = (row - duplicate_logit).abs() < TIE_TOLERANCE
            kept_duplicate = is_duplicate & (is_duplicate.cumsum(0) <= num_keep)
            outlier &= ~(is_duplicate & ~kept_duplicate)
            exps = torch.where(outlier, row, NEG_INF) - max_logit
            exps = exps.exp()
            sum_exp = exps.sum()
            probs = exps[outlier] / sum_exp
            high = (max_logit - max_logit).exp() / sum_exp
            low = (k_pivot - max_logit).exp() / sum_exp
            p_pivot, smallest, num_smallest, mass = _bisect_top_p(probs, p, low, high)
            duplicate_logit = torch.log(smallest * sum_exp) + max_logit
            num_duplicates = num_smallest
            num_keep = _num_to_keep(num_smallest, mass, p, smallest)
            final_pivot = torch.log(p_pivot * sum_exp) + max_logit
    if p is not None and final_pivot == NEG_INF and p < 1.0:
        # top_p alone; probabilities shifted by mean + 10 std of the first tile (8192 on CUDA)
        sample = row[:8192][finite[:8192]]
        mean = sample.mean() if sample.numel() else f32(0.0)
        square_mean = (sample * sample).mean() if sample.numel() else f32(0.0)
        std = torch.clamp(square_mean - mean * mean, min=0.0).sqrt()
        max_sample = mean + std * f32(10.0)
        max_logit = row.max()
        min_logit = torch.minimum(row[finite].min() if bool(finite.any()) else f32(float("inf")), max_logit)
        exps = (row - max_sample).exp()
        sum_exp = exps.sum()
        probs = exps / sum_exp
        high = (max_logit - max_sample).exp() / sum_exp
        low = (min_logit - max_sample).exp() / sum_exp
        p_pivot, smallest, num_smallest, mass = _bisect_top_p(probs, p, low, high)
        duplicate_logit = torch.log(smallest * sum_exp) + max_sample
        num_duplicates = num_smallest
        num_keep = _num_to_keep(num_smallest, mass, p, smallest)
        final_pivot = torch.log(p_pivot * sum_exp) + max_sample
    if not bool(final_pivot < max_logit) or final_pivot == NEG_INF:
        return row.clone()
    keep = row > final_pivot
    if num_keep < num_duplicates:
        is_duplicate = (row - duplicate_logit).abs() < TIE_TOLERANCE
        kept_duplicate = is_duplicate & (is_duplicate.cumsum(0) <= num_keep)
        keep &= ~(is_duplicate & ~kept_duplicate)
    return torch.where(keep, row, NEG_INF)


def split_top_p_kernel(logits: torch.Tensor, p: float) -> torch.Tensor:
    """[N, V] float32 -> a copy with the split-row pipeline's top_p applied to each row (one slice)."""
    return torch.stack([_split_top_p_row(row, f32(p)) for row in logits])


def _split_top_p_row(row: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    finite = row > NEG_INF
    if p >= 1.0 or not bool(finite.any()):
        return row.clone()
    row_max = row.max()
    total = torch.where(finite, (row - row_max).exp(), f32(0.0)).sum()
    max_prob = f32(1.0) / total
    min_prob = torch.clamp((row[finite].min() - row_max).exp() / total, min=1e-30)
    if max_prob <= min_prob * f32(1.0 + 1e-6):
        return row.clone()  # (nearly) uniform
    probs = (row - row_max).exp() / total
    low, high = min_prob, max_prob
    best, best_mass, best_smallest, best_ties = f32(-1.0), f32(0.0), f32(1.0), 0
    pivot, mass_kept, duplicate, num_duplicates = f32(0.0), f32(0.0), f32(1.0), 1
    no_mask = False
    for round_index in range(SPLIT_ROUNDS):
        # a geometric ladder of SPLIT_FANOUT pivots inside (low, high)
        steps = torch.arange(SPLIT_FANOUT, dtype=torch.float32)
        pivots = low * (torch.log(high / low) * (steps + 1.0) / f32(SPLIT_FANOUT + 1.0)).exp()
        stats = [_mass_above(probs, pivot_i) for pivot_i in pivots]
        masses = torch.stack([s[0] for s in stats])
        smallest = torch.stack([s[1] for s in stats])
        ties = torch.tensor([s[2] for s in stats], dtype=torch.float32)
        reaches = masses >= p
        exact = reaches & (masses - smallest * ties < p)
        if bool(reaches.any()):
            index = int(reaches.nonzero().max())
            if pivots[index] > best:
                best, best_mass = pivots[index], masses[index]
                best_smallest, best_ties = smallest[index], int(ties[index])
        if bool(exact.any()):
            index = int(exact.nonzero().max())
            pivot, mass_kept, duplicate, num_duplicates = (
                pivots[index],
                masses[index],
                smallest[index],
                int(ties[index]),
            )
            break
        new_low = torch.maximum(low, pivots[reaches].max() if bool(reaches.any()) else f32(NEG_INF))
        new_high = torch.minimum(
            high, pivots[~reaches].min() if bool((~reaches).any()) else f32(float("inf"))
        )
        if round_index == SPLIT_ROUNDS - 1 or not bool(new_high > new_low * f32(1.0 + 1e-7)):
            if best > 0.0:
                pivot, mass_kept, duplicate, num_duplicates = best, best_mass, best_smallest, best_ties
            else:
                no_mask = True
            break
        low, high = new_low, new_high
    if no_mask or bool(pivot * total >= 1.0):
        return row.clone()
    surplus = int((torch.clamp(mass_kept - p, min=0.0) / duplicate).item())
    num_keep = min(max(num_duplicates - surplus, 1), num_duplicates)
    keep = row > torch.log(pivot) + torch.log(total) + row_max
    if num_keep < num_duplicates:
        # ties matched in probability space, lowest index first
        is_duplicate = (row - row_max).exp() / total == duplicate
        kept_duplicate = is_duplicate & (is_duplicate.cumsum(0) <= num_keep)
        keep &= ~is_duplicate | kept_duplicate
    return torch.where(keep, row, NEG_INF)


def cuda_v2_sampler(
    logits: torch.Tensor, k: int | None, p: float | None, min_p: float, split: bool
) -> torch.Tensor:
    """Model Runner V2's truncation of [N, V] tempered float32 logits: min_p, then top_k/top_p
    (`split`: the split-row pipeline, taken for top_p alone in batches of at most 64 sequences)."""
    logits = min_p_kernel(logits, min_p)
    if split and k is None and p is not None:
        return split_top_p_kernel(logits, p)
    if k is None and p is None:
        return logits
    return topk_topp_kernel(logits, k, p)
