"""The Megatron backend publishes full HF-named weights that reproduce its policy."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo[megatron])")

from trainer_batches import make_row, on_policy_batch, reference_logprobs

from grpo.config.trainer import TrainerConfig
from grpo.trainer.megatron.export import buckets


@pytest.mark.usefixtures("float32_compute")
def test_published_weights_after_a_step_give_the_trainers_logprobs_in_hf(
    tiny_llama_tp2_path: Path, megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from grpo.trainer.megatron.trainer import MegatronTrainer
    from grpo.utils.atomic import is_stable

    trainer = MegatronTrainer(megatron_cfg(model=str(tiny_llama_tp2_path), learning_rate=1e-2), tmp_path)
    rows = [make_row([(5, 9), (4, 8)], [1.0, -1.0], seed=4, temperature=0.9)]
    trainer.train_step(on_policy_batch(trainer, 0, copy.deepcopy(rows)))
    folder = trainer.publish(1)
    assert folder is not None and is_stable(folder)
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()
    trained = trainer.score(rows)
    before = reference_logprobs(tiny_llama_tp2_path, rows)
    published = reference_logprobs(folder, rows)
    trainer.close()
    assert np.abs(trained[0] - before[0]).max() > 1e-2  # the step changed the policy
    np.testing.assert_allclose(published[0], trained[0], atol=2e-5)


def test_buckets_hold_at_most_the_bound_and_keep_every_tensor_once() -> None:
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 30, 5, 60, 1])}  # float32: 4 B each
    groups = buckets(tensors, max_bytes=160)
    assert [list(g) for g in groups] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    assert all(sum(t.numel() * 4 for t in g.values()) <= 160 or len(g) == 1 for g in groups)


def test_a_folder_of_several_buckets_loads_into_hf_as_one_checkpoint(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from grpo.trainer.megatron.export import write_hf_folder
    from grpo.trainer.megatron.model import read_hf_weights

    tensors = read_hf_weights(tiny_model_path)
    write_hf_folder(tensors, tiny_model_path, tmp_path, max_bytes=2 * 1024**2)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) >= 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
