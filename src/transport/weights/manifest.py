"""The manifest of one collective weight update: which tensors follow, checked before any is allocated.

The sender writes it to the rendezvous store as JSON (`{"step": s, "tensors": [[name, dtype,
shape], ...]}`, no pickle); a receiver checks it against the served model's own tensor shapes, so
a peer cannot make a server allocate what its model does not have (grpo.transport.weights.collective).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch

# dtypes a state dict can hold; names are parsed against this list, never eval'd.
_DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)


def _dtype_from_name(tensor_name: str, name: str) -> torch.dtype:
    import torch

    if name not in _DTYPE_NAMES:
        raise ValueError(
            f"weight update gives tensor {tensor_name!r} unsupported dtype {name!r}; supported: "
            f"{', '.join(_DTYPE_NAMES)}"
        )
    return getattr(torch, name)


def check_manifest(
    manifest: object, expected: Mapping[str, Sequence[int]] | None
) -> tuple[int, list[tuple[str, torch.dtype, list[int]]]]:
    """The step and (name, dtype, shape) of each tensor an update announces, checked before anything
    is allocated: a well-formed document, supported dtypes, no name twice; against `expected` (HF
    name -> shape of the served model's tensors) also only its names, exactly its shapes and
    floating dtypes. ValueError naming the tensor otherwise. `expected` None checks the document
    alone (a transport test; a server always passes its model's shapes)."""
    if not (
        isinstance(manifest, dict)
        and type(manifest.get("step")) is int
        and isinstance(manifest.get("tensors"), list)
    ):
        raise ValueError(
            'weight update manifest is not {"step": int, "tensors": [[name, dtype, shape], ...]}'
        )
    entries: list[tuple[str, torch.dtype, list[int]]] = []
    seen: set[str] = set()
    for entry in manifest["tensors"]:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and isinstance(entry[1], str)
            and isinstance(entry[2], list)
            and all(type(size) is int and size >= 0 for size in entry[2])
        ):
            raise ValueError(
                f"weight update manifest entry {str(entry)[:200]} is not [name, dtype, [sizes >= 0]]"
            )
        name, dtype_name, shape = entry
        if name in seen:
            raise ValueError(f"weight update names tensor {name!r} twice")
        seen.add(name)
        dtype = _dtype_from_name(name, dtype_name)
        if expected is not None:
            if name not in expected:
                raise UserError(
                    f"weight update names tensor {name!r}, which the served model does not have; "
                    "do the trainer and the inference server run the same model?"
                )
            if shape != list(expected[name]):
                raise UserError(
                    f"weight update gives tensor {name!r} shape {shape}, but the served model's is "
                    f"{list(expected[name])}; do the trainer and the inference server run the same model?"
                )
            if not dtype.is_floating_point:
                raise ValueError(
                    f"weight update gives tensor {name!r} dtype {dtype_name}; model weights are floating point"
                )
        entries.append((name, dtype, shape))
    return manifest["step"], entries
