"""The loss knobs (PPO clip with clip-higher, truncated IS, CISPO) in a 2-step co-located run on the
tiny model: the run trains, publishes and reports the knobs' metrics. The run samples with top_k and
top_p in float32, so step 0 also shows the trainer reproducing vLLM's truncated logprobs; and with a
stop string, so the tokens of completions vLLM ended on one train with vLLM's logprobs too."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from grpo.orchestrator.reporting.rollout_log import rollouts_file
from grpo.utils.jsonl import read_jsonl

ColocatedArgs = Callable[..., list[str]]  # the colocated_args fixture (tests/conftest.py)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    ("overrides", "metrics"),
    [
        (
            ["--train.loss.clip_low", "0.8", "--train.loss.clip_high", "1.28", "--train.loss.tis_cap", "2"],
            ["clip_frac_low", "clip_frac_high", "tis_frac_capped"],
        ),
        # cispo trains through the same co-located path with another loss.type (passed once, 170 s
        # on the 2-core CPU); kept out of make test's time budget, its formula is pinned in
        # tests/trainer/test_ratio_clip.py.
    ],
    ids=["ppo_clip_tis"],
)
def test_two_colocated_steps_train_with_the_knob_and_report_its_metrics(
    tmp_path: Path, colocated_args: ColocatedArgs, overrides: list[str], metrics: list[str]
) -> None:
    run_dir = tmp_path / "run"
    # Qwen3's card settings are top_k 20, top_p 0.95; 0.9 truncates more of the tiny model's
    # flatter distribution. float32 so that what remains of the mismatch is the truncation's.
    sampling = [
        "--orch.sampling.top_k",
        "20",
        "--orch.sampling.top_p",
        "0.9",
        "--infer.dtype",
        "float32_on_cpu",
    ]
    # "e" ends most of the tiny model's completions within 16 tokens (docs/loss.md "Stop strings")
    stop = ["--orch.sampling.stop", "e"]
    args = [*colocated_args(run_dir, max_steps=2, max_async_level=0), *sampling, *stop, *overrides]
    result = subprocess.run(
        [str(BIN / "grpo"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("loss", "mismatch_kl", "grad_norm", *metrics)), row
    # On policy at step 0 (same weights, same temperature, same truncation): every ratio is ~1,
    # nothing is clipped or masked. Without the trainer's truncation the masks drop every token here
    # (measured: masked 1.0).
    assert rows[0]["mismatch_kl"] < 1e-4 and rows[0]["masked"] == 0.0, rows[0]
    assert all(rows[0][k] == 0.0 for k in metrics), rows[0]
    assert rows[0]["grad_norm"] > 0.0  # the knobs leave the on-policy gradient in place
    assert (run_dir / "broadcasts" / "step_2" / "STABLE").exists()
    # the rewards scored vLLM's text, cut before the stop string; a stop is not a truncation
    rollouts = [
        json.loads(line) for line in gzip.decompress(rollouts_file(run_dir, 0).read_bytes()).splitlines()
    ]
    assert all("e" not in r["completion"] for r in rollouts), rollouts
    assert any(not r["truncated"] and r["num_tokens"] > 0 for r in rollouts), rollouts
