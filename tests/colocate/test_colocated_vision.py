"""A co-located run of a vision-language model on vLLM's CPU engine: the tiny Idefics3 (SmolVLM's
family) trains 2 steps on the built-in count-shapes task, its images sent to the engine and kept
for the trainer, the language model's linears borrowed and the vision tower loaded by the trainer.
140-170 s here (2 runs), most of it the engine's start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.utils.jsonl import read_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BIN = Path(sys.executable).parent


def test_two_colocated_steps_of_count_shapes_on_a_tiny_idefics3_train_on_the_engines_image_prompts(
    tmp_path: Path, tiny_idefics3_model_path: Path
) -> None:
    run_dir = tmp_path / "run"
    model = str(tiny_idefics3_model_path)
    (tmp_path / "train.yaml").write_text(f"model: {model}\n")
    (tmp_path / "infer.yaml").write_text(f"model: {model}\n")
    env = {"id": "count-shapes", "args": {"num_examples": 4, "image_size": 64, "max_shapes": 3}}
    (tmp_path / "orch.yaml").write_text(json.dumps({"env": [env]}))
    args = [
        *("--train", "train.yaml", "--infer", "infer.yaml", "--orch", "orch.yaml"),
        *("--train.output_dir", str(run_dir), "--train.max_steps", "2", "--train.max_async_level", "0"),
        *("--train.sequence_len", "256", "--train.lora_rank", "8", "--train.optimizer", "adamw"),
        *("--orch.batch_size", "4", "--orch.rollouts_per_example", "2", "--orch.sampling.max_tokens", "8"),
        *("--orch.report_to", '{"offline": true}', "--infer.port", "0", "--infer.max_num_seqs", "8"),
    ]
    result = subprocess.run(
        [str(BIN / "grpo"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The memory plan counts the trainer's own copy of the vision tower; 2 layers x 7 linears borrowed.
    assert "vision tower" in result.stderr and "loaded from disk (not borrowed)" in result.stderr
    assert "borrowed 14 base weights" in result.stderr
    trainer = read_jsonl(run_dir / "trainer_metrics.jsonl")
    assert [r["step"] for r in trainer] == [0, 1]
    # The trainer's logprobs of the engine's image prompts are the engine's (same weights, step 0):
    # nothing masked for mismatch. (An lm_head vLLM did not tie masked every token.)
    assert trainer[0]["masked"] == 0.0 and trainer[0]["mismatch_kl"] < 1e-3 and trainer[0]["tokens"] > 0
    orch = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["policy/version"] for r in orch] == [0, 1]
    assert (run_dir / "broadcasts" / "step_2" / "STABLE").exists()
