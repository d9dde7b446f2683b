from __future__ import annotations

from grpo.config.crosscheck import check_inference
from grpo.config.inference import InferenceConfig
from grpo.config.orchestrator import OrchestratorConfig


def _problems(max_model_len: int, max_tokens: int | None, seq_len: int = 1024) -> list[str]:
    orch = OrchestratorConfig.model_validate({"seq_len": seq_len, "sampling": {"max_tokens": max_tokens}})
    infer = InferenceConfig.model_validate({"model": "m", "max_model_len": max_model_len})
    return check_inference(infer, None, orch)


def test_a_null_max_tokens_needs_a_max_model_len_that_holds_seq_len() -> None:
    # A null max_tokens asks for seq_len minus the prompt: vLLM refuses more than max_model_len holds.
    (problem,) = _problems(max_model_len=512, max_tokens=None)
    assert "max_tokens null" in problem and "max_model_len (512)" in problem
    assert _problems(max_model_len=1024, max_tokens=None) == []
    assert _problems(max_model_len=512, max_tokens=64) == []
