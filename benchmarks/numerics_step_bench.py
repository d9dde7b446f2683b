"""CPU cost of following vLLM's roundings in the bf16 trainer (grpo.trainer.hf.vllm_numerics):
forward and backward of decoder layers of the embedded SmolLM2-135M's shapes, per numerics variant.

    python benchmarks/numerics_step_bench.py [--layers 2] [--rows 4] [--row-tokens 256] [--repeats 5]

A `--layers`-layer Llama decoder with the embedded model's config (hidden 576, 9 heads, 3 KV
heads, intermediate 1536; random bf16 weights), frozen as a LoRA base is; each step runs the
decoder over `rows x row-tokens` bf16 input states under bf16 autocast and back-propagates into
the input (the activation gradients a LoRA step computes through every layer). The lm_head and
embeddings, the same in every variant, are left out. Variants alternate, so load changes hit all
alike; reported: the minimum and the median step time of each (the minimum is the least disturbed
by other processes on a shared machine). Variants: `hf` (transformers' order), `vllm_eager_rounding`,
`vllm_rounding` (the compiled engine's, the default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from e2e_bench import load_average


def _decoder(variant: str, num_layers: int):  # -> LlamaModel
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from grpo.models.embedded import build
    from grpo.trainer.hf.vllm_numerics import follow_vllm_rounding

    config = AutoConfig.from_pretrained(build())
    config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).requires_grad_(False)
    if variant != "hf":
        assert follow_vllm_rounding(model, engine_compiled=variant == "vllm_rounding") == num_layers
    return model.model


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default="hf,vllm_eager_rounding,vllm_rounding")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    variants = args.variants.split(",")
    decoders = {v: _decoder(v, args.layers) for v in variants}
    hidden = torch.randn(args.rows, args.row_tokens, decoders[variants[0]].config.hidden_size).bfloat16()
    times: dict[str, list[float]] = {v: [] for v in variants}
    load_before = load_average()
    for repeat in range(args.repeats + 1):
        for variant in variants:
            x = hidden.clone().requires_grad_(True)
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = decoders[variant](inputs_embeds=x).last_hidden_state
            out.float().pow(2).mean().backward()
            if repeat:  # the first round warms up
                times[variant].append(time.perf_counter() - start)
    for variant in variants:
        row = {"variant": variant, "min_s": round(min(times[variant]), 3)}
        row |= {
            "median_s": round(statistics.median(times[variant]), 3),
            "steps_s": [round(t, 3) for t in times[variant]],
        }
        row |= {"layers": args.layers, "rows": args.rows, "row_tokens": args.row_tokens}
        row |= {"load_average_before": load_before, "load_average_after": load_average()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
