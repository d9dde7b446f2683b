"""The few numbers of a model's config.json that memory estimates need (no torch import)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grpo.models.moe import config_namespace, mlp_weights

# Input and output width of each HF linear module of a Llama/Qwen-style decoder layer.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


VISION_TOWER_PREFIXES = ("visual.", "vision_model.", "connector.", "vision_tower.", "multi_modal_projector.")
"""Top-level modules (under `model.`, where the model nests them) of a vision tower and its projector."""


def has_vision_tower(path: str | Path) -> bool:
    """Whether the model in folder `path` is a vision-language model (its config.json has a
    vision_config)."""
    return "vision_config" in json.loads((Path(path) / "config.json").read_text())


def in_vision_tower(name: str) -> bool:
    """Whether a parameter name (HF's or vLLM's) belongs to the vision tower or its projector."""
    return name.removeprefix("model.").startswith(VISION_TOWER_PREFIXES)


def num_vision_tower_params(path: str | Path) -> int:
    """Parameters of the vision tower and its projector in folder `path`'s safetensors (their
    headers only); 0 for a text model."""
    import struct

    if not has_vision_tower(path):
        return 0
    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name != "__metadata__" and in_vision_tower(name):
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    mlp_params: int | None = None
    """Weights of every layer's MLP, each routed expert, shared expert and router of a
    mixture-of-experts model counted (grpo.models.moe); None: gate, up and down of
    intermediate_size in every layer."""
    num_vision_params: int = 0
    """Vision tower and projector of a vision-language model (not borrowed: the trainer loads its own)."""
    activation_value_bytes: int = 2
    """Bytes per activation value in the trainer: its compute dtype's width, which config.json does
    not say (2 for bfloat16 or float16, 4 for a float32 trainer, such as one borrowing a float32 CPU
    engine's weights); grpo.trainer.activation_plan sizes activations with it."""

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelShape:
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        num_heads = cfg["num_attention_heads"]
        mlp = mlp_weights(config_namespace(path))
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            mlp_params=mlp.total + mlp.router if mlp.is_moe else None,
            num_vision_params=num_vision_tower_params(path),
        )

    def linear_dims(self, name: str) -> tuple[int, int]:
        """(in_features, out_features) of one decoder-layer linear module."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[name]

    def num_linear_params(self) -> int:
        """Parameters in the decoder layers' linear modules (the weights the trainer borrows), every
        expert of a mixture-of-experts model included."""
        if self.mlp_params is None:
            return self.num_layers * sum(a * b for a, b in map(self.linear_dims, LINEAR_MODULES))
        attention = ("q_proj", "k_proj", "v_proj", "o_proj")
        return self.num_layers * sum(a * b for a, b in map(self.linear_dims, attention)) + self.mlp_params

    def max_linear_numel(self) -> int:
        return max(a * b for a, b in map(self.linear_dims, LINEAR_MODULES))

    def num_lora_params(self, rank: int, targets: list[str]) -> int:
        names = LINEAR_MODULES if "all-linear" in targets else [t for t in targets if t in LINEAR_MODULES]
        return self.num_layers * sum(rank * (a + b) for a, b in map(self.linear_dims, names))

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value
