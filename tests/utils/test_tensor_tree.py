"""A nested state dict survives safetensors + JSON unchanged: keys of any kind, tuples, dtypes, exact floats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo.utils.tensor_tree import load_tree, save_tree


def test_a_megatron_like_state_dict_round_trips_exactly(tmp_path: Path) -> None:
    flat = torch.arange(10, dtype=torch.float32) / 3
    tree = {
        "optimizer": {
            "state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(3, 4)}},
            "param_groups": [
                {"betas": (0.9, 0.999), "lr": 1 / 3, "foreach": None, "params": [0], "eps": 1e-8}
            ],
        },
        # Views of one buffer (safetensors refuses shared memory: each is stored on its own).
        "fp32_from_fp16_params": [[flat[:4], flat[4:]]],
        0: {(torch.bfloat16, torch.float32): {"param": flat, "numel_unpadded": 10}},
        "odd": [math.inf, -0.0, "text", True],
    }
    save_tree(tree, tmp_path / "t.json", tmp_path / "t.safetensors")
    loaded = load_tree(tmp_path / "t.json", tmp_path / "t.safetensors")

    def same(got: object, want: object) -> None:
        assert isinstance(want, torch.Tensor) or type(got) is type(want), (got, want)
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
        elif isinstance(want, dict):
            assert isinstance(got, dict) and list(got) == list(want)
            for key in want:
                same(got[key], want[key])
        elif isinstance(want, list | tuple):
            assert isinstance(got, list | tuple) and len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                same(g, w)
        elif isinstance(want, float):
            assert isinstance(got, float) and got == want and math.copysign(1, got) == math.copysign(1, want)
        else:
            assert got == want

    same(loaded, tree)
    assert "__tensor__" in (tmp_path / "t.json").read_text()  # the JSON names tensors, never holds them
    json.loads((tmp_path / "t.json").read_text())


def test_an_object_that_is_not_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="object"):
        save_tree({"x": object()}, tmp_path / "t.json", tmp_path / "t.safetensors")


def test_a_tensor_stored_twice_is_written_twice(tmp_path: Path) -> None:
    shared = torch.arange(4, dtype=torch.float32)
    save_tree({"a": shared, "b": shared}, tmp_path / "t.json", tmp_path / "t.safetensors")
    loaded = load_tree(tmp_path / "t.json", tmp_path / "t.safetensors")
    assert torch.equal(loaded["a"], shared) and torch.equal(loaded["b"], shared)
