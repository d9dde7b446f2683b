"""Model FLOPs of a training step, for the `tflops` and `mfu` metrics.

Model FLOPs count the arithmetic the update needs, not what the machine did: recomputation under
gradient checkpointing, padding and masked-out attention scores are left out, as in the usual MFU
definition (PaLM, appendix B). Per token that passes through the decoder:

  decoder linears   forward 2 P, backward 2 P for the activations' gradients, + 2 P for the weights'
                    gradients when the base is trained (full updates), + 6 P_lora for LoRA's own
                    matrices (forward, activations' and weights' gradients)
  attention scores  forward 4 d_attn per attended key per layer (Q K^T and A V), backward twice that

and per loss token the output layer (only loss tokens get logits in grpo's trainer): forward 2 V H,
backward 2 V H, + 2 V H when the output layer is trained. A shared prefix is counted once, because it
is computed once; every token attends its ancestors, so the attended keys of a micro-batch are the
sum of (position + 1), capped at the window on sliding-window layers.

P comes from the model's config (attention and MLP projections of every layer, active experts only
for mixture-of-experts models), so quantized bases count the same as 16-bit ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo.models.moe import mlp_weights


@dataclass(frozen=True)
class ModelFlopShape:
    num_layers: int
    hidden_size: int
    attention_width: int
    """num_heads x head_dim: the width of Q (and of the attention output)."""
    num_decoder_linear_params: int
    """Weights of every decoder layer's projections (active experts only)."""
    vocab_size: int
    sliding_window: int | None
    num_sliding_layers: int


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def flop_shape(config: Any) -> ModelFlopShape:
    """The counts above from an HF model config (the text config of a multimodal one)."""
    config = getattr(config, "text_config", None) or config
    hidden = int(config.hidden_size)
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(_first(config, "num_key_value_heads", default=num_heads))
    head_dim = int(_first(config, "head_dim", default=hidden // num_heads))
    attention = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)  # q, o; k, v
    # Gated MLPs (every family the trainer accepts): gate, up, down; for MoE the top-k routed
    # experts, shared experts and dense layers (grpo.models.moe), not the experts a token skips.
    mlp = mlp_weights(config).active
    num_layers = int(config.num_hidden_layers)
    window = _first(config, "sliding_window")
    layer_types = getattr(config, "layer_types", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        num_sliding = 0
    elif layer_types is not None:
        num_sliding = sum(1 for kind in layer_types if kind == "sliding_attention")
    else:
        num_sliding = num_layers
    return ModelFlopShape(
        num_layers=num_layers,
        hidden_size=hidden,
        attention_width=num_heads * head_dim,
        num_decoder_linear_params=num_layers * attention + mlp,
        vocab_size=int(config.vocab_size),
        sliding_window=int(window) if num_sliding else None,
        num_sliding_layers=num_sliding,
    )


def attended_keys(position_ids: Any, sliding_window: int | None) -> tuple[int, int]:
    """[T] positions within each token's own sequence -> (keys attended by full-attention layers,
    keys attended by sliding-window layers), summed over the tokens."""
    full = int((position_ids + 1).sum())
    if sliding_window is None:
        return full, full
    return full, int((position_ids + 1).clamp(max=sliding_window).sum())


def step_model_flops(
    shape: ModelFlopShape,
    *,
    num_tokens: int,
    num_full_keys: int,
    num_window_keys: int,
    num_loss_tokens: int,
    trains_base: bool,
    trains_output_layer: bool,
    num_lora_params: int,
) -> float:
    """Model FLOPs of one step's forward and backward over its micro-batches."""
    linear_per_token = (6 if trains_base else 4) * shape.num_decoder_linear_params + 6 * num_lora_params
    num_full_layers = shape.num_layers - shape.num_sliding_layers
    keys = num_full_layers * num_full_keys + shape.num_sliding_layers * num_window_keys
    attention = 12 * shape.attention_width * keys
    head_per_token = (6 if trains_output_layer else 4) * shape.vocab_size * shape.hidden_size
    return float(linear_per_token * num_tokens + attention + head_per_token * num_loss_tokens)


class StepFlopCounter:
    """Adds up one step's micro-batches on this rank; `model_flops` turns them into FLOPs."""

    def __init__(
        self,
        shape: ModelFlopShape,
        *,
        trains_base: bool,
        trains_output_layer: bool,
        num_lora_params: int,
        device: Any,
        dtype: Any,
    ) -> None:
        from grpo.trainer.peak_flops import describe_peak, peak_flops

        self.shape = shape
        self.trains_base = trains_base
        self.trains_output_layer = trains_output_layer
        self.num_lora_params = num_lora_params
        # Measured here, as the trainer starts: after a step a co-located engine may be generating
        # on the same cores, and a probe then reads a fraction of the machine.
        self.peak_flops = peak_flops(device, dtype)[0]
        self.peak_description = describe_peak(device, dtype)
        """For the trainer's start-up log: what `mfu` divides by."""
        self.reset()

    def reset(self) -> None:
        self.num_tokens = self.num_full_keys = self.num_window_keys = self.num_loss_tokens = 0

    def add(self, position_ids: Any, num_loss_tokens: int) -> None:
        """One micro-batch: its [T] positions (depth along each token's own path) and loss tokens."""
        full, window = attended_keys(position_ids, self.shape.sliding_window)
        self.num_tokens += int(position_ids.numel())
        self.num_full_keys += full
        self.num_window_keys += window
        self.num_loss_tokens += num_loss_tokens

    def model_flops(self) -> float:
        return step_model_flops(
            self.shape,
            num_tokens=self.num_tokens,
            num_full_keys=self.num_full_keys,
            num_window_keys=self.num_window_keys,
            num_loss_tokens=self.num_loss_tokens,
            trains_base=self.trains_base,
            trains_output_layer=self.trains_output_layer,
            num_lora_params=self.num_lora_params,
        )

    def take_rates(self, step_time: float, num_model_shards: int = 1) -> dict[str, float]:
        """The step's flop_rate_metrics against the peak measured at construction (this rank
        computing 1/num_model_shards of the model: tensor x pipeline parallel), then start the next
        step."""
        model_flops = self.model_flops() / num_model_shards
        self.reset()
        return flop_rate_metrics(model_flops, step_time, self.peak_flops)


def flop_rate_metrics(model_flops: float, step_time: float, peak_flops: float) -> dict[str, float]:
    """`model_tflops_per_s` (this rank's model FLOPs over the step's compute seconds) and `mfu` (that
    over one device's peak)."""
    rate = model_flops / max(step_time, 1e-9)
    return {"model_tflops_per_s": rate / 1e12, "mfu": rate / peak_flops}
