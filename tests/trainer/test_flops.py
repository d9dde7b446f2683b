"""Model FLOPs behind the trainer's `mfu` metric: the counts come from the config and agree with the
models the trainer builds; attention counts ancestors along each token's own path."""

from __future__ import annotations

import pytest
import torch
from model_families import FAMILIES, MOE_FAMILIES, _config

from grpo.trainer.flops import StepFlopCounter, attended_keys, flop_rate_metrics, flop_shape, step_model_flops
from grpo.trainer.peak_flops import describe_peak, peak_flops, table_peak_tflops

DENSE = [f for f in FAMILIES if f not in MOE_FAMILIES]


@pytest.mark.parametrize("family", DENSE)
def test_decoder_linear_parameters_equal_the_built_models_projection_weights(family):
    from transformers import AutoModelForCausalLM

    config = _config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    projections = sum(
        p.numel() for name, p in model.model.layers.named_parameters() if p.dim() == 2 and "norm" not in name
    )
    assert flop_shape(config).num_decoder_linear_params == projections


@pytest.mark.parametrize(
    ("family", "num_sliding"),
    [("llama", 0), ("qwen3", 0), ("qwen2", 1), ("mistral", 2), ("gemma2", 1), ("phi3", 2)],
)
def test_sliding_layers_are_counted_per_layer_kind(family, num_sliding):
    shape = flop_shape(_config(family))
    assert shape.num_sliding_layers == num_sliding
    assert (shape.sliding_window is None) == (num_sliding == 0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_mixture_of_experts_count_the_top_k_of_the_built_models_expert_weights(family):
    """Dense layers and shared experts count whole; of the fused experts (3-D) top_k of num_experts."""
    from transformers import AutoModelForCausalLM

    config = _config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    num_experts = getattr(config, "num_local_experts", None) or config.num_experts
    dense, experts = 0, 0
    for name, p in model.model.layers.named_parameters():
        if p.dim() == 3:
            experts += p.numel()
        elif p.dim() == 2 and not any(s in name for s in ("norm", "bias", ".gate.", "router", "expert_gate")):
            dense += p.numel()
    active = dense + experts * config.num_experts_per_tok // num_experts
    assert flop_shape(config).num_decoder_linear_params == active


def test_mixture_of_experts_counts_the_active_experts_only():
    config = _config("gpt_oss")
    shape = flop_shape(config)
    per_layer_mlp = 3 * config.hidden_size * config.intermediate_size * config.num_experts_per_tok
    attention = (
        config.hidden_size * config.head_dim * 2 * (config.num_attention_heads + config.num_key_value_heads)
    )
    assert shape.num_decoder_linear_params == config.num_hidden_layers * (per_layer_mlp + attention)


def test_a_token_attends_its_ancestors_and_a_window_caps_them():
    # a prompt of 3 tokens shared by two completions of 2 tokens: depths 0 1 2 | 3 4 | 3 4
    positions = torch.tensor([0, 1, 2, 3, 4, 3, 4])
    assert attended_keys(positions, None) == (1 + 2 + 3 + 4 + 5 + 4 + 5, 1 + 2 + 3 + 4 + 5 + 4 + 5)
    assert attended_keys(positions, 2) == (24, 1 + 2 + 2 + 2 + 2 + 2 + 2)


def test_full_updates_add_the_weight_gradients_lora_adds_its_own_matrices():
    shape = flop_shape(_config("llama"))
    counts = {"num_tokens": 100, "num_full_keys": 3000, "num_window_keys": 3000, "num_loss_tokens": 40}
    lora = step_model_flops(
        shape, **counts, trains_base=False, trains_output_layer=False, num_lora_params=1000
    )
    full = step_model_flops(shape, **counts, trains_base=True, trains_output_layer=True, num_lora_params=0)
    p, v, h = shape.num_decoder_linear_params, shape.vocab_size, shape.hidden_size
    assert full - (lora - 6 * 1000 * 100) == 2 * p * 100 + 2 * v * h * 40
    # the forward alone is a third of the full update's linear FLOPs (forward 2P, backward 4P per token)
    forward = 2 * p * 100 + 4 * shape.attention_width * 3000 * shape.num_layers + 2 * v * h * 40
    assert full == pytest.approx(3 * forward)


def test_the_counter_adds_micro_batches_and_starts_over_after_reset():
    counter = StepFlopCounter(
        flop_shape(_config("llama")),
        trains_base=True,
        trains_output_layer=True,
        num_lora_params=0,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    counter.add(torch.tensor([0, 1, 2]), num_loss_tokens=2)
    counter.add(torch.tensor([0, 1]), num_loss_tokens=1)
    assert (counter.num_tokens, counter.num_full_keys, counter.num_loss_tokens) == (5, 9, 3)
    assert counter.model_flops() > 0
    counter.reset()
    assert counter.model_flops() == 0


def test_spec_table_names_the_data_center_gpus_and_longer_names_win():
    assert table_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert table_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert table_peak_tflops("NVIDIA H200") == 989.4
    assert table_peak_tflops("NVIDIA A10G") == 70.0
    assert table_peak_tflops("Some Future GPU") is None


def test_the_cpu_peak_is_probed_in_the_compute_dtype_and_mfu_is_a_fraction_of_it():
    peak, source = peak_flops(torch.device("cpu"), torch.float32)
    assert source == "probe" and 1e9 < peak < 1e14
    metrics = flop_rate_metrics(model_flops=peak * 0.5, step_time=1.0, peak_flops=peak)
    assert metrics["mfu"] == pytest.approx(0.5)
    assert metrics["model_tflops_per_s"] == pytest.approx(peak * 0.5 / 1e12)


def test_the_probe_keeps_the_fastest_of_its_products_through_a_slow_moment(monkeypatch):
    """Products slowed by another process's burst do not lower the peak: the probe keeps timing for
    a quarter second and takes the fastest. The products are stand-ins of fixed duration (50 ms for
    the first three timed, 1 ms after), so the machine's own load cannot decide the outcome."""
    import time

    import grpo.trainer.peak_flops as peak_module

    calls = []

    def mm_slowed_at_first(a, b):
        calls.append(1)
        time.sleep(0.05 if 2 <= len(calls) <= 4 else 0.001)  # call 1 is the untimed warm-up
        return a

    monkeypatch.setattr(torch, "mm", mm_slowed_at_first)
    peak = peak_module._probe_flops.__wrapped__("cpu", "float32", torch.get_num_threads())
    slowed = 2.0 * 1024**3 / 0.05
    assert len(calls) > 4 and peak > 10 * slowed


def test_the_trainers_start_up_line_names_the_peak_its_mfu_divides_by():
    line = describe_peak(torch.device("cpu"), torch.float32)
    peak, _ = peak_flops(torch.device("cpu"), torch.float32)
    assert line == f"float32 peak {peak / 1e9:,.0f} GFLOP/s (matmul probe on cpu)"
