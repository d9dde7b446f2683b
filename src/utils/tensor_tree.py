"""Nested state (an optimizer's state dict) on disk without pickle: its tensors in one safetensors
file, everything else (the structure, numbers, strings, booleans, None, torch dtypes) in one JSON file.

In the JSON a tensor is {"__tensor__": name} (its name in the safetensors file), a dict is
{"__dict__": [[key, value], ...]} (keys may be ints, tuples or dtypes, as in Megatron's state dicts),
a tuple {"__tuple__": [...]}, a dtype {"__dtype__": "float32"}; lists, strings, numbers, booleans
and None are themselves. Floats survive the round trip exactly (JSON writes their shortest repr,
inf and nan included).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_TENSOR, _DICT, _TUPLE, _DTYPE = "__tensor__", "__dict__", "__tuple__", "__dtype__"


def encode(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able structure, tensors by name on the CPU, each in memory of its own)."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            name = str(len(tensors))
            tensors[name] = _own_cpu_tensor(node.detach(), storages)
            return {_TENSOR: name}
        if isinstance(node, torch.dtype):
            return {_DTYPE: str(node).removeprefix("torch.")}
        if isinstance(node, dict):
            return {_DICT: [[walk(k), walk(v)] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v) for v in node]}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if node is None or isinstance(node, bool | int | float | str):
            return node
        raise TypeError(f"cannot store a {type(node).__name__} in a tensor tree")

    return walk(tree), tensors


def _own_cpu_tensor(tensor: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """`tensor` itself when it is a whole CPU allocation not stored yet (a gathered optimizer state:
    no second copy of it), else a contiguous CPU copy (safetensors refuses tensors sharing memory,
    such as views of one flat buffer)."""
    import torch

    storage = tensor.untyped_storage()
    whole = (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and storage.nbytes() == tensor.numel() * tensor.element_size()
        and storage.data_ptr() not in storages
    )
    if not whole:
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
    storages.add(tensor.untyped_storage().data_ptr())
    return tensor


def decode(encoded: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """The tree `encode` flattened; `tensor(name)` reads one tensor."""
    import torch

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        ((tag, value),) = node.items()
        if tag == _TENSOR:
            return tensor(value)
        if tag == _DTYPE:
            dtype = getattr(torch, value)
            assert isinstance(dtype, torch.dtype), value
            return dtype
        if tag == _TUPLE:
            return tuple(walk(v) for v in value)
        assert tag == _DICT, tag
        return {_hashable(walk(k)): walk(v) for k, v in value}

    return walk(encoded)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def save_tree(tree: Any, json_path: Path, tensors_path: Path) -> None:
    from safetensors.torch import save_file

    encoded, tensors = encode(tree)
    save_file(tensors, str(tensors_path))
    json_path.write_text(json.dumps(encoded))


def load_tree(json_path: Path, tensors_path: Path) -> Any:
    """The tree save_tree wrote (tensors on the CPU)."""
    from safetensors.torch import load_file

    return decode(json.loads(json_path.read_text()), load_file(str(tensors_path)).__getitem__)
