"""The Megatron backend publishes full HF-named weights that reproduce its policy."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra (pip install grpo-rl[megatron])")

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


def test_qerl_noise_on_full_megatron_weights_matches_the_hf_backends_and_trains_on_clean_norms(
    tiny_model_path: Path, megatron_cfg: Callable[..., TrainerConfig], tmp_path: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from grpo.trainer.megatron.trainer import MegatronTrainer
    from grpo.trainer.noise import noisy_norms

    noise = {"enabled": True, "num_stages": 2, "sigma_start": 0.1, "sigma_end": 0.01}
    cfg = megatron_cfg(max_steps=4, noise_scheduler=noise)
    trainer = MegatronTrainer(cfg, tmp_path)
    clean_before = trainer.hf_state_dict()
    first = load_file(str(trainer.publish(1) / "noisy_norms.safetensors"))
    late_folder = trainer.publish(3)
    assert late_folder is not None
    late = load_file(str(late_folder / "noisy_norms.safetensors"))
    clean_after = trainer.hf_state_dict()
    trainer.close()
    assert clean_before is not None and clean_after is not None
    # The policy trains and publishes clean norms; the noise is only in the file the servers apply.
    published = load_file(str(late_folder / "model.safetensors"))
    for name in late:
        assert torch.equal(clean_after[name], clean_before[name]) and torch.equal(
            published[name], clean_before[name]
        )
    assert torch.equal(first["model.norm.weight"], clean_before["model.norm.weight"].float())  # no noise yet
    noisy = late["model.norm.weight"] - clean_before["model.norm.weight"].float()
    assert noisy.std().item() == pytest.approx(0.1, rel=0.3)
    # Every norm the hf backend would noise, with the very same noise for the same weights and version.
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    expected = noisy_norms(hf, sigma=0.1, seed=cfg.seed + 3)
    assert set(late) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(late[name], tensor), name
