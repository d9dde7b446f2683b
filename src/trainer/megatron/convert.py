"""HF <-> Megatron parameter names and layouts for Llama-style decoders, and tensor-parallel slicing.

Three forms of the same weights:
- HF: the checkpoint's names (`model.layers.3.self_attn.q_proj.weight`, ...).
- whole Megatron: megatron-core's names with global layer numbers and unsplit tensors.
- local Megatron: one rank's slice (its tensor-parallel part of its pipeline stage's layers, layer
  numbers counted within the stage), what the rank's GPTModel holds.

Layouts that differ from HF:
- `linear_qkv` fuses q, k and v grouped per KV head: for each KV group, its q heads, then its k
  head, then its v head ([groups x (q_per_group + 2) x head_dim, hidden]); a tensor-parallel rank
  holds whole groups, so the fused tensor splits evenly along dim 0.
- `linear_fc1` fuses [gate; up]; a tensor-parallel rank holds [its gate rows; its up rows], so
  splitting and merging re-slice gate and up separately.
- MoE layers (Qwen3-MoE): HF's router `mlp.gate` is `mlp.router`; expert j's gate/up/down are
  `mlp.experts.local_experts.j.linear_fc1` ([gate; up]) / `linear_fc2` (SequentialMLP); q_norm and
  k_norm are `self_attention.q_layernorm` / `k_layernorm`.
- Expert parallelism: a rank holds num_experts / ep_size experts of each MoE layer, numbered from 0
  (`local_experts.j`); the whole model's expert is ep_rank * num_local + j (global_expert_name).
- Row-parallel linears (`linear_proj`, `linear_fc2`) split along dim 1; column-parallel ones, the
  embedding and the output layer along dim 0; norms are replicated.
Norm names depend on the layer spec: the local spec has `input_layernorm` / `pre_mlp_layernorm`,
TransformerEngine's fuses them into `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`.

This mapping is ours rather than a conversion library's (see README: Megatron backend): it is the
whole of what the supported architectures need, and it covers both layer specs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo.utils.errors import UserError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DecoderShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    num_experts: int = 0
    """Routed experts of each decoder layer's MoE MLP (0: a dense MLP in every layer)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3's q_norm, k_norm)."""

    @classmethod
    def from_hf_config(cls, config: object) -> DecoderShape:
        heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        hidden = int(config.hidden_size)  # type: ignore[attr-defined]
        return cls(
            num_layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            num_experts=int(getattr(config, "num_experts", None) or 0),
            qk_norm=type(config).__name__.startswith("Qwen3"),
        )

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class NormNames:
    """Where the two per-layer norms live in a layer spec (suffixes after `decoder.layers.{i}.`)."""

    attention: str
    mlp: str


LOCAL_SPEC_NORMS = NormNames("input_layernorm.weight", "pre_mlp_layernorm.weight")
TE_SPEC_NORMS = NormNames("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
TE_SPEC_MOE_NORMS = NormNames("self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight")
"""TransformerEngine's spec with MoE layers: the MLP's norm stays its own module (no fused fc1)."""

# Megatron layer suffix -> HF layer suffix, for tensors that map one to one.
_ONE_TO_ONE = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
_QKV_NORMS = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
"""One-to-one tensors of Qwen3(-MoE) layers: q/k norms and the MoE router [experts, hidden]."""
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_FC1 = "mlp.linear_fc1.weight"
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: DecoderShape) -> torch.Tensor:
    """HF q [heads*d, ...], k, v [kv_heads*d, ...] -> Megatron grouped [groups*(qpg+2)*d, ...]."""
    import torch

    d, groups = shape.head_dim, shape.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(groups, shape.q_per_group * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: DecoderShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, groups, qpg = shape.head_dim, shape.num_kv_heads, shape.q_per_group
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (qpg + 2) * d, *rest)
    q = grouped[:, : qpg * d].reshape(-1, *rest)
    k = grouped[:, qpg * d : (qpg + 1) * d].reshape(-1, *rest)
    v = grouped[:, (qpg + 1) * d :].reshape(-1, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def hf_to_megatron(
    hf: dict[str, torch.Tensor], shape: DecoderShape, norms: NormNames = LOCAL_SPEC_NORMS
) -> dict[str, torch.Tensor]:
    """HF state dict -> whole Megatron state dict (no lm_head when the embeddings are tied).

    UserError when the checkpoint holds a tensor this mapping has no place for (a bias or norm of
    a variant the config checks did not catch): leaving it out would train another model."""
    import torch

    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return hf[name]

    out = {
        "embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": take("model.norm.weight"),
    }
    if not shape.tied_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    for i in range(shape.num_layers):
        hf_prefix, prefix = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf_prefix + "self_attn."
        out[prefix + norms.attention] = take(hf_prefix + "input_layernorm.weight")
        out[prefix + norms.mlp] = take(hf_prefix + "post_attention_layernorm.weight")
        for megatron_suffix, hf_suffix in _ONE_TO_ONE.items():
            out[prefix + megatron_suffix] = take(hf_prefix + hf_suffix)
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" in hf:
                q, k, v = (take(attn + f"{p}_proj.{kind}") for p in "qkv")
                out[prefix + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(q, k, v, shape)
        for megatron_suffix, hf_suffix in _QKV_NORMS.items():
            if hf_prefix + hf_suffix in hf:
                out[prefix + megatron_suffix] = take(hf_prefix + hf_suffix)
        mlps = [(hf_prefix + "mlp.", prefix + "mlp.")]
        if shape.num_experts:  # SequentialMLP's experts, numbered as HF numbers them (one EP rank)
            mlps = [
                (hf_prefix + f"mlp.experts.{j}.", prefix + f"mlp.experts.local_experts.{j}.")
                for j in range(shape.num_experts)
            ]
        for hf_mlp, mlp in mlps:
            gate_up = [take(hf_mlp + "gate_proj.weight"), take(hf_mlp + "up_proj.weight")]
            out[mlp + "linear_fc1.weight"] = torch.cat(gate_up)
            out[mlp + "linear_fc2.weight"] = take(hf_mlp + "down_proj.weight")
    # A tied checkpoint may still store lm_head (the embedding again); old ones store RoPE's inv_freq.
    unmapped = sorted(
        name
        for name in set(hf) - used
        if not (name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"))
    )
    if unmapped:
        more = f" and {len(unmapped) - 3} more" if len(unmapped) > 3 else ""
        raise UserError(
            f"the checkpoint holds tensors backend megatron has no place for ({', '.join(unmapped[:3])}{more}); "
            "use backend: hf"
        )
    return out


_HF_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def is_hf_norm(name: str) -> bool:
    """Whether HF name `name` (as megatron_to_hf writes them) is an RMSNorm weight."""
    return name == "model.norm.weight" or name.endswith(_HF_NORMS)


def megatron_to_hf(
    whole: dict[str, torch.Tensor], shape: DecoderShape, norms: NormNames = LOCAL_SPEC_NORMS
) -> dict[str, torch.Tensor]:
    """Whole Megatron state dict -> HF state dict (lm_head left out when tied: loaders re-tie it)."""
    out = {
        "model.embed_tokens.weight": whole["embedding.word_embeddings.weight"],
        "model.norm.weight": whole["decoder.final_layernorm.weight"],
    }
    if not shape.tied_embeddings:
        out["lm_head.weight"] = whole["output_layer.weight"]
    hf_norms = dict(zip((norms.attention, norms.mlp), _HF_NORMS, strict=True))
    for name, tensor in whole.items():
        match = _LAYER.match(name)
        if match is None:
            continue
        hf_prefix, suffix = f"model.layers.{match[1]}.", match[2]
        if suffix in hf_norms:
            out[hf_prefix + hf_norms[suffix]] = tensor
        elif suffix in _ONE_TO_ONE:
            out[hf_prefix + _ONE_TO_ONE[suffix]] = tensor
        elif suffix in _QKV_NORMS:
            out[hf_prefix + _QKV_NORMS[suffix]] = tensor
        elif suffix == "mlp.linear_fc2.weight":
            out[hf_prefix + "mlp.down_proj.weight"] = tensor
        elif (expert := _EXPERT.match(suffix)) is not None:
            hf_mlp = hf_prefix + f"mlp.experts.{expert[1]}."
            if expert[2] == "linear_fc2":
                out[hf_mlp + "down_proj.weight"] = tensor
            else:
                gate, up = tensor.chunk(2)
                out[hf_mlp + "gate_proj.weight"] = gate.contiguous()
                out[hf_mlp + "up_proj.weight"] = up.contiguous()
        elif suffix in _QKV:
            kind = suffix.rsplit(".", 1)[1]
            for p, part in zip("qkv", _split_qkv(tensor, shape), strict=True):
                out[hf_prefix + f"self_attn.{p}_proj.{kind}"] = part
        elif suffix == _FC1:
            gate, up = tensor.chunk(2)
            out[hf_prefix + "mlp.gate_proj.weight"] = gate.contiguous()
            out[hf_prefix + "mlp.up_proj.weight"] = up.contiguous()
        elif not suffix.endswith("_extra_state"):
            raise KeyError(f"no HF name for Megatron parameter {name}")
    return out


def split_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits `name` along (None: replicated on every rank)."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(
        (
            "word_embeddings.weight",
            "output_layer.weight",
            "linear_qkv.weight",
            "linear_qkv.bias",
            "linear_fc1.weight",
        )
    ):
        return 0
    return None


def tp_slice(name: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's part of the whole tensor `name`."""
    import torch

    dim = split_dim(name)
    if dim is None or tp_size == 1:
        return tensor
    if name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]]).contiguous()
    return tensor.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def tp_merge(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor `name` from every tensor-parallel rank's part, in rank order."""
    import torch

    dim = split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(part.chunk(2) for part in parts), strict=True)
        return torch.cat([*gates, *ups])
    return torch.cat(parts, dim=dim)


def global_layer_name(local_name: str, layer_offset: int) -> str:
    """A stage's parameter name (layers counted within the stage) -> the whole model's name."""
    match = _LAYER.match(local_name)
    if match is None:
        return local_name
    return f"decoder.layers.{int(match[1]) + layer_offset}.{match[2]}"


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def global_expert_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """An expert-parallel rank's parameter name (its experts numbered from 0) -> the whole model's:
    local expert j of rank r is expert r * num_local_experts + j, as megatron-core numbers them."""
    match = _LOCAL_EXPERT.match(name)
    if match is None or ep_rank == 0:
        return name
    return f"{match[1]}{ep_rank * num_local_experts + int(match[2])}{match[3]}"


def is_expert_name(name: str) -> bool:
    """Whether Megatron name `name` is a routed expert's weight (split over expert-parallel ranks)."""
    return _LOCAL_EXPERT.match(name) is not None


def hf_layer_index(hf_name: str) -> int | None:
    match = _HF_LAYER.match(hf_name)
    return None if match is None else int(match[1])
