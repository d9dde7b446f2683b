"""vLLM's truncation rules on CUDA, where its sampler is not the CPU engine's (vLLM 0.32).

On CUDA vLLM runs Model Runner V2 unless VLLM_USE_V2_MODEL_RUNNER=0 (or a feature V2 lacks sends it
back to V1). V2's sampler (v1/worker/gpu/sample/sampler.py) divides the logits by the temperature
in float32, applies min_p in logit space with a Triton kernel (sample/min_p.py), then top_k/top_p
with the Triton kernels of v1/sample/ops/topk_topp_triton.py (grpo's processed logprobs rule out
the fused FlashInfer sampler). V1 on CUDA applies min_p on probabilities, as the CPU engine does,
and top_k/top_p with the same Triton kernels. The rules, as those kernels apply them:

  min_p   keep a logit >= max logit + log(min_p), both terms and the sum in float32
  top_k   keep exactly k tokens: those above the k-th largest logit, then of the tokens equal to
          it the lowest indices (the CPU engine keeps every token equal to the k-th)
  top_p   keep the fewest most likely tokens whose probability reaches top_p (float32 p): a token
          stays while the mass before it, most likely first, is below p; of equal probabilities
          the lowest index comes first. Where that needs the least likely token left and top_k
          did not cut the row (off, or no more than k tokens left after min_p), the bisection,
          which only tries pivots above that token's probability, never reaches p and cuts just
          above it: that token is dropped.

The kernels reach these by pivot searches with iteration caps, and the trainer does not repeat
the searches, so it differs from them where they stop short (tests/trainer/cuda_sampler_kernels.py
transcribes them): where the probabilities either side of the top_p cut lie closer than 18
bisections resolve (about 4e-6 of the largest probability; common in the tail of a large
vocabulary) the kernel cuts at its last midpoint; where the mass before a token lies within
float32 rounding of p, sums in another order can flip it; the one-program kernel (taken with
top_k on, or for top_p alone over more than 64 sequences) matches top_p ties after a log/exp
round trip that may miss them and keep the tie whole; and the split-row pipeline (top_p alone over
at most 64 sequences) keeps the whole row where the least likely token is needed, and more tokens
than needed where its 5 rounds of 8 pivots cannot place the cut. Which top_p kernel ran depends on
the engine's batch at that step, which the trainer does not see; it follows the one-program kernel.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from grpo.transport.batches.batch import EngineSampler

MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM's switch between its model runners (unset: V2 on CUDA)."""
MAX_BISECTIONS = 18
"""The top_p kernel's cap on its bisection steps."""
BISECTION_TOLERANCE = 1e-9
"""The top_p kernel stops bisecting a probability range narrower than this."""


def engine_sampler_on(device_type: str) -> EngineSampler:
    """The sampler of a vLLM engine on `device_type` ("cpu", "cuda") started from this process's
    environment: a co-located engine shares the trainer's device and environment."""
    if device_type != "cuda":
        return "cpu"
    runner_v2 = os.environ.get(MODEL_RUNNER_ENV)
    # vLLM reads the variable as bool(int(value)).
    return "cuda_v1" if runner_v2 is not None and not int(runner_v2) else "cuda_v2"


def min_p_kept_on_logits(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """[N, V] float32 tempered logits -> [N, V] bool: Model Runner V2's min_p."""
    import torch

    log_min_p = torch.log(torch.tensor(min_p, dtype=torch.float32, device=logits.device))
    return logits >= logits.amax(dim=-1, keepdim=True) + log_min_p


def top_k_kept_by_index(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[N, V] float32 logits (dropped ones -inf) -> [N, V] bool: exactly top_k tokens, ties with the
    k-th largest logit taken lowest index first."""
    import torch

    order = logits.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, True)
    # fewer finite logits than top_k: the kernel leaves the row alone; the -inf ones stay dropped
    return keep | torch.isfinite(logits).sum(dim=-1, keepdim=True).le(top_k)


def top_p_kept_by_index(logits: torch.Tensor, top_p: float, cut_by_top_k: torch.Tensor) -> torch.Tensor:
    """[N, V] float32 logits (dropped ones -inf) -> [N, V] bool: the fewest most likely tokens
    whose probability reaches top_p, equal probabilities taken lowest index first. `cut_by_top_k`
    ([N, 1] bool): rows whose top_p search starts below the least likely token, at the top_k pivot."""
    import torch

    descending, order = logits.sort(dim=-1, descending=True, stable=True)
    # exp(x - max) / sum, as the kernels form each probability
    exps = (descending - descending[:, :1]).exp()
    probs = exps / exps.sum(dim=-1, keepdim=True)
    mass_before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(dim=-1)[:, :-1]], dim=-1)
    keep_sorted = mass_before < torch.tensor(top_p, dtype=torch.float32, device=logits.device)
    pivot = _pivot_when_the_least_likely_is_needed(probs, keep_sorted)
    keep_sorted &= cut_by_top_k | (probs > pivot)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _pivot_when_the_least_likely_is_needed(probs: torch.Tensor, keep_sorted: torch.Tensor) -> torch.Tensor:
    """[N, V] probabilities (descending) and the minimal prefix kept -> [N, 1]: where the prefix
    reaches the least likely token left, the probability the kernel ends up cutting above; -1
    elsewhere. Its bisection only tries pivots above the least likely probability, so no pivot
    reaches top_p: after MAX_BISECTIONS halvings toward it it cuts at the last midpoint."""
    import torch

    num_finite = probs.gt(0).sum(dim=-1, keepdim=True)
    least = probs.gather(-1, num_finite - 1)
    boundary = probs.gather(-1, keep_sorted.sum(dim=-1, keepdim=True) - 1)
    low, high = least, probs[:, :1]
    for _ in range(MAX_BISECTIONS):
        high = torch.where(high - low < BISECTION_TOLERANCE, high, (high - low) * 0.5 + low)
    # a row of one probability keeps all: the pivot would not lie below its largest logit
    applies = (boundary == least) & (least < probs[:, :1])
    return torch.where(applies, (high + low) / 2.0, torch.full_like(least, -1.0))
