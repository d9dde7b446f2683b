"""What differs between model families past attention: final-logit soft-capping, module names.

Gemma-2 soft-caps its final logits (`cap * tanh(logits / cap)`) inside its CausalLM forward, which
the trainer bypasses (it runs the decoder, then the lm_head only on the tokens it needs), so the
head it uses applies the cap itself. Scaled embeddings (Gemma), attention sinks (gpt-oss) and q/k
norms (Qwen3) live inside the decoder and need nothing here.

Names are checked at load so that a family laid out differently fails in one line instead of
training something else: LoRA targets that the model does not have (Phi-3 fuses q/k/v into
`qkv_proj` and gate/up into `gate_up_proj`, so the default targets would silently adapt only
o_proj and down_proj), and base weights borrowed from the engine under names the HF model lacks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from grpo.utils.errors import UserError


class SoftCappedHead(nn.Module):
    """An output layer followed by the model's final-logit soft-capping."""

    def __init__(self, head: nn.Module, cap: float) -> None:
        super().__init__()
        self.head = head
        self.cap = cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        return torch.tanh(logits / self.cap) * self.cap


def output_layer(causal_lm: nn.Module) -> nn.Module:
    """The module that turns final hidden states into the logits the model samples from."""
    head = causal_lm.get_output_embeddings()
    assert head is not None
    cap = getattr(causal_lm.config.get_text_config(), "final_logit_softcapping", None)
    return SoftCappedHead(head, float(cap)) if cap is not None else head


def check_lora_targets(causal_lm: nn.Module, targets: Iterable[str]) -> None:
    """Raise UserError if a named LoRA target is no module of the model."""
    names = {name.rpartition(".")[2] for name, _ in causal_lm.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        linears = sorted(
            {n.rpartition(".")[2] for n, m in causal_lm.named_modules() if isinstance(m, nn.Linear)}
            - {"lm_head"}
        )
        raise UserError(
            f"{causal_lm.config.model_type} has no {', '.join(missing)} modules; set lora_target_modules to "
            f"some of its linear layers ({', '.join(linears)}) or to all-linear"
        )


def check_borrowed_names(causal_lm: nn.Module, names: Iterable[str]) -> None:
    """Raise UserError if the engine hands over weights under names the HF model does not have
    (a parameter name, or a module name for a quantized linear)."""
    modules = dict(causal_lm.named_modules())

    def exists(name: str) -> bool:
        module_name, _, attr = name.rpartition(".")
        return name in modules or isinstance(getattr(modules.get(module_name), attr, None), nn.Parameter)

    missing = [n for n in names if not exists(n)]
    if missing:
        raise UserError(
            f"{causal_lm.config.model_type}: the engine's base weights do not map onto the HF model's "
            f"(e.g. {missing[0]}; its fused projections are named differently); co-located weight sharing "
            "does not support this model, run grpo-infer and grpo-train as separate processes"
        )
