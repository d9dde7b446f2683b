"""An engine on CUDA truncates by Model Runner V2's rules (min_p on logits, exactly top_k tokens, the
fewest tokens reaching top_p, ties lowest index first), and the trainer follows them when its
engine runs there; the reference is a plain-torch transcription of vLLM's kernels
(tests/trainer/cuda_sampler_kernels.py)."""

from __future__ import annotations

import cuda_sampler_kernels as kernels
import pytest
import torch

from grpo.trainer.cuda_sampling_truncation import MODEL_RUNNER_ENV, engine_sampler_on
from grpo.trainer.sampling_truncation import kept_tokens, truncated_log_softmax
from grpo.transport.batches.batch import SamplingTruncation


def _logits(seed: int, num_rows: int, num_vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, num_vocab, generator=generator) * 3.0


def _on_cuda(**settings) -> SamplingTruncation:
    return SamplingTruncation(engine_sampler="cuda_v2", **settings)


def test_the_engine_sampler_is_the_cpu_engines_on_cpu_and_model_runner_v2_on_cuda(monkeypatch):
    monkeypatch.delenv(MODEL_RUNNER_ENV, raising=False)
    assert engine_sampler_on("cpu") == "cpu"
    assert engine_sampler_on("cuda") == "cuda_v2"
    monkeypatch.setenv(MODEL_RUNNER_ENV, "0")
    assert engine_sampler_on("cuda") == "cuda_v1"
    assert engine_sampler_on("cpu") == "cpu"
    monkeypatch.setenv(MODEL_RUNNER_ENV, "1")
    assert engine_sampler_on("cuda") == "cuda_v2"


def test_a_token_on_the_min_p_boundary_is_kept_in_logit_space_on_cuda_and_by_probability_on_cpu():
    """8,192 rows with token 1 placed exactly at max + log(min_p): Model Runner V2's kernel keeps
    every one; the probability rule of the CPU engine (and of V1 on CUDA) drops most of them."""
    min_p = 0.05
    logits = _logits(0, 8192, 64)
    logits[:, 1:2] = logits.amax(dim=-1, keepdim=True) + torch.log(torch.tensor(min_p))
    kernel_kept = torch.isfinite(kernels.min_p_kernel(logits, min_p))
    on_cuda = kept_tokens(logits, _on_cuda(min_p=min_p))
    on_cpu = kept_tokens(logits, SamplingTruncation(min_p=min_p))
    assert torch.equal(on_cuda, kernel_kept)
    assert bool(kernel_kept[:, 1].all())
    assert int((~on_cpu[:, 1]).sum()) > 4000  # the rules disagree on most boundary tokens
    probs = logits.softmax(dim=-1)
    assert torch.equal(on_cpu, probs >= probs.amax(dim=-1, keepdim=True) * min_p)
    assert torch.equal(kept_tokens(logits, SamplingTruncation(min_p=min_p, engine_sampler="cuda_v1")), on_cpu)


def test_top_k_on_cuda_keeps_exactly_k_tokens_ties_with_the_kth_lowest_index_first():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0], [0.0, 2.0, 1.0, 2.0, 2.0, 3.0]])
    expected = [[True, True, False, False, False, False], [False, True, False, False, False, True]]
    assert torch.isfinite(kernels.topk_topp_kernel(logits, 2, None)).tolist() == expected
    assert kept_tokens(logits, _on_cuda(top_k=2)).tolist() == expected
    assert kept_tokens(logits, SamplingTruncation(top_k=2)).tolist() == [  # the CPU engine keeps ties
        [True, True, True, True, False, False],
        [False, True, False, True, True, True],
    ]


def test_top_k_on_cuda_matches_the_kernel_on_rows_full_of_ties():
    logits = (_logits(1, 64, 200) * 2).round() / 2  # a coarse grid: many logits equal the k-th
    truncation = _on_cuda(top_k=20)
    kept = kept_tokens(logits, truncation)
    assert torch.equal(kept, torch.isfinite(kernels.topk_topp_kernel(logits, 20, None)))
    assert bool((kept.sum(dim=-1) == 20).all())
    assert not torch.equal(kept, kept_tokens(logits, SamplingTruncation(top_k=20)))


def test_top_p_on_cuda_keeps_the_fewest_tokens_reaching_it_ties_lowest_index_first():
    """Three tokens tie at the cutoff; one of them is needed. The split-row kernel keeps the lowest
    index; the CPU engine's ascending sort keeps the highest."""
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0, -4.0, -4.0, -4.0, -4.0]])
    probs = logits.softmax(dim=-1)[0]
    top_p = float(probs[0] + probs[1] / 2)
    on_cuda = kept_tokens(logits, _on_cuda(top_p=top_p))
    assert on_cuda.tolist() == [[True, True, False, False, False, False, False, False]]
    assert torch.equal(on_cuda, torch.isfinite(kernels.split_top_p_kernel(logits, top_p)))
    assert kept_tokens(logits, SamplingTruncation(top_p=top_p)).tolist() == [
        [True, False, False, True, False, False, False, False]
    ]


def _rows_with_top_probability(top_p: float, offsets: list[float]) -> torch.Tensor:
    """Rows [0, second, six unlikely tokens] whose first probability is top_p + offset (float64),
    so the cut falls just before or after the second token and not on the least likely one."""
    rows = []
    for offset in offsets:
        rest = 1 / (top_p + offset) - 1  # exp(second) + 6 exp(-9)
        rows.append(
            [0.0, float(torch.log(torch.tensor(rest - 6 * torch.e**-9.0, dtype=torch.float64))), *[-9.0] * 6]
        )
    return torch.tensor(rows)


@pytest.mark.parametrize("top_p", [0.8, 0.9, 0.95, 0.99])
def test_the_top_p_cut_on_cuda_keeps_a_token_while_the_mass_before_it_is_below_p(top_p):
    offsets = [-1e-4, -1e-5, -3e-6, 3e-6, 1e-5, 1e-4]
    rows = _rows_with_top_probability(top_p, offsets)
    on_cuda = kept_tokens(rows, _on_cuda(top_p=top_p))
    assert on_cuda[:, 1].tolist() == [offset < 0 for offset in offsets]
    assert torch.equal(on_cuda, torch.isfinite(kernels.topk_topp_kernel(rows, None, top_p)))
    assert torch.equal(on_cuda, torch.isfinite(kernels.split_top_p_kernel(rows, top_p)))


@pytest.mark.parametrize("top_p", [0.8, 0.9, 0.95, 0.99])
def test_within_float32_units_of_the_cut_cuda_compares_p_and_the_cpu_engine_1_minus_p(top_p):
    """The most likely probability within a few float32 units of p: on CUDA the second token stays
    iff that probability (exp(x - max) / sum) is below the float32 p; the CPU engine compares the
    mass from below with 1 - p, and the two disagree on some of these rows."""
    rows = _rows_with_top_probability(top_p, torch.linspace(-3e-7, 3e-7, 61).tolist())
    on_cuda = kept_tokens(rows, _on_cuda(top_p=top_p))
    exps = (rows - rows[:, :1]).exp()
    top_probability = exps[:, 0] / exps.sum(dim=-1)
    assert torch.equal(on_cuda[:, 1], top_probability < torch.tensor(top_p, dtype=torch.float32))
    assert 0 < int(on_cuda[:, 1].sum()) < rows.shape[0]
    assert not torch.equal(on_cuda, kept_tokens(rows, SamplingTruncation(top_p=top_p)))


def test_top_p_on_cuda_drops_the_least_likely_token_left_when_the_cut_falls_on_it():
    """After min_p only a few tokens are left; when top_p needs the least likely of them, the
    kernel's bisection never tries a pivot below it and the token is cut."""
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 1e-4, 1e-4]]))
    truncation = _on_cuda(top_p=0.95, min_p=0.05)
    expected = [[True, True, False, False, False]]
    reference = kernels.cuda_v2_sampler(logits, None, 0.95, 0.05, split=False)
    assert torch.isfinite(reference).tolist() == expected
    assert kept_tokens(logits, truncation).tolist() == expected


def test_top_p_after_a_top_k_cut_on_cuda_keeps_the_least_likely_token_when_needed():
    """With top_k cutting the row, the kernel's top_p search starts at the top_k pivot, below the
    least likely token top_k kept; with no more tokens left than k, top_p alone cuts it."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]))  # last: -inf
    for top_k, top_p, expected in [
        (3, 0.95, [True, True, True, False, False]),
        (4, 0.97, [True, True, True, False, False]),
    ]:
        assert torch.isfinite(kernels.topk_topp_kernel(logits, top_k, top_p)).tolist() == [expected]
        assert kept_tokens(logits, _on_cuda(top_k=top_k, top_p=top_p)).tolist() == [expected]
    after_min_p = [[True, True, False, False, False]]  # 3 left: top_k 4 does not cut
    assert torch.isfinite(kernels.cuda_v2_sampler(logits, 4, 0.97, 0.2, split=False)).tolist() == after_min_p
    assert kept_tokens(logits, _on_cuda(top_k=4, top_p=0.97, min_p=0.2)).tolist() == after_min_p


def _cut_is_clear(probs_sorted: torch.Tensor, num_kept: int, top_p: float) -> bool:
    """Whether the kernel's top_p search settles this cut: the probabilities on either side of it
    lie further apart than 18 bisections of [least, largest] resolve, and the masses before them
    lie further from p than float32 sums in another order could move them (both with margin)."""
    if num_kept >= int(probs_sorted.gt(0).sum()):
        return True
    gap = float(probs_sorted[num_kept - 1] - probs_sorted[num_kept])
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    nearest = float((mass_before[num_kept - 1 : num_kept + 1] - top_p).abs().min())
    return gap > 2 * float(probs_sorted[0]) / 2**18 and nearest > 1e-6


CASES = [
    {"top_k": 20},
    {"top_p": 0.9},
    {"min_p": 0.05},
    {"top_k": 20, "top_p": 0.9},
    {"top_p": 0.95, "min_p": 0.1},
    {"top_k": 50, "top_p": 0.8, "min_p": 0.02},
]


@pytest.mark.parametrize("settings", CASES, ids=str)
def test_the_trainer_keeps_what_model_runner_v2_keeps_wherever_its_searches_converge(settings):
    logits = _logits(2, 400, 1000)
    truncation = _on_cuda(**settings)
    kernel = kernels.cuda_v2_sampler(
        logits, settings.get("top_k"), settings.get("top_p"), settings.get("min_p", 0.0), split=False
    )
    kept = kept_tokens(logits, truncation)
    differs = (kept != torch.isfinite(kernel)).any(dim=-1)
    for row in differs.nonzero()[:, 0].tolist():
        before_top_p = kernels.min_p_kernel(logits[row : row + 1], settings.get("min_p", 0.0))
        if "top_k" in settings:
            before_top_p = kernels.topk_topp_kernel(before_top_p, settings["top_k"], None)
        probs = before_top_p[0].softmax(dim=-1).sort(descending=True).values
        assert not _cut_is_clear(probs, int(kept[row].sum()), settings.get("top_p", 1.0)), f"row {row}"
    assert int(differs.sum()) <= 0.02 * logits.shape[0]
    # the logprobs are the log-softmax over the kept tokens, as the engine's processed logprobs
    expected = kernel.log_softmax(dim=-1)
    got = truncated_log_softmax(logits, truncation)
    same = ~differs
    torch.testing.assert_close(got[same][kept[same]], expected[same][kept[same]], atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [32, 128], ids=["split_top_p", "one_program"])
def test_the_trainer_keeps_what_vllms_own_cuda_kernels_keep(num_rows):
    """vLLM's kernels themselves (Model Runner V2's min_p, the Triton top_k/top_p) on a Qwen3-sized
    vocabulary; 32 rows take the split-row top_p pipeline, 128 the one-program kernel. Run by
    scripts/gpu_validate.sh on a GPU machine with vLLM."""
    pytest.importorskip("vllm", reason="vLLM is not installed: its CUDA sampler kernels cannot run here")
    from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton
    from vllm.v1.worker.gpu.sample.min_p import apply_min_p

    logits = _logits(3, num_rows, 151936).cuda() / 0.7
    rows = torch.arange(num_rows, dtype=torch.int32, device="cuda")
    for settings in CASES:
        k, p, min_p = settings.get("top_k"), settings.get("top_p"), settings.get("min_p", 0.0)
        engine = logits.clone()
        apply_min_p(engine, rows, torch.full((num_rows,), min_p, device="cuda"))
        if k is not None or p is not None:
            engine = apply_top_k_top_p_triton(
                engine,
                None if k is None else torch.full((num_rows,), k, dtype=torch.int32, device="cuda"),
                None if p is None else torch.full((num_rows,), p, dtype=torch.float32, device="cuda"),
            )
        kept = kept_tokens(logits, _on_cuda(**settings))
        differs = (kept != torch.isfinite(engine)).any(dim=-1).cpu()
        print(f"{settings}: {int(differs.sum())} of {num_rows} rows keep other tokens than vLLM")
        if p is None:
            assert not bool(differs.any())
        for row in differs.nonzero()[:, 0].tolist():
            before_top_p = kernels.min_p_kernel(logits[row : row + 1].cpu(), min_p)
            if k is not None:
                before_top_p = kernels.topk_topp_kernel(before_top_p, k, None)
            probs = before_top_p[0].softmax(dim=-1).sort(descending=True).values
            num_left = int(torch.isfinite(before_top_p).sum())
            if num_rows <= 64 and k is None and int(torch.isfinite(engine[row]).sum()) == num_left:
                continue  # the split pipeline keeps the whole row where the cut needs the least likely
            assert not _cut_is_clear(probs, int(kept[row].sum()), p), f"{settings} row {row}"
