"""vLLM's adapter loading (/v1/load_lora_adapter, SageMaker's POST /adapters) through grpo's patch:
the path checked is the path loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from grpo.inference.vllm_compat.app import reset_inplace_flag_after_lora_load
from grpo.inference.weight_routes import WeightRouteRules

pytest.importorskip("vllm")


class FakeEngineClient:
    """Records the LoRA requests vLLM's serving layer hands the engine."""

    model_config: Any = None
    renderer: Any = None
    input_processor: Any = None

    def __init__(self) -> None:
        self.added: list[Any] = []

    async def add_lora(self, lora_request: Any) -> bool:
        self.added.append(lora_request)
        return True


def _serving_models(rules: WeightRouteRules) -> tuple[Any, FakeEngineClient]:
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    reset_inplace_flag_after_lora_load()
    engine = FakeEngineClient()
    models = OpenAIServingModels(engine, [BaseModelPath(name="base", model_path="/m")])  # type: ignore[arg-type]
    models.grpo_lora_path_check = rules.resolve_allowed  # type: ignore[attr-defined]
    return models, engine


def _load(models: Any, path: Path) -> Any:
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    return asyncio.run(
        models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="policy", lora_path=str(path)))
    )


def test_an_adapter_is_loaded_from_the_resolved_path_not_the_link_the_client_named(tmp_path: Path) -> None:
    (tmp_path / "run" / "step_1").mkdir(parents=True)
    (tmp_path / "run" / "current").symlink_to(tmp_path / "run" / "step_1")
    models, engine = _serving_models(WeightRouteRules(weight_dirs=((tmp_path / "run").resolve(),)))
    _load(models, tmp_path / "run" / "current")
    assert [r.lora_path for r in engine.added] == [str((tmp_path / "run" / "step_1").resolve())]


def test_an_adapter_outside_weight_dirs_never_reaches_the_engine(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    models, engine = _serving_models(WeightRouteRules(weight_dirs=((tmp_path / "run").resolve(),)))
    response = _load(models, tmp_path / "elsewhere")
    assert response.error.code == 403 and "weight_dirs" in response.error.message
    assert engine.added == []
