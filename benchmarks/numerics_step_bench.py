"""CPU cost of following vLLM's roundings in the trainer (grpo.trainer.hf.vllm_numerics): forward
and backward of the bf16 LoRA policy on the embedded SmolLM2-135M, per numerics variant, same batch.

    python benchmarks/numerics_step_bench.py [--rows 4] [--row-tokens 256] [--steps 3]

Each step: the decoder over `rows x row-tokens` random tokens under bf16 autocast, float32 logits
from the bf16 lm_head, log-softmax of the next token, backward of their mean into the LoRA weights
(no gradient checkpointing, no optimizer step). The first step is a warm-up and not timed.
Variants as benchmarks/mismatch_bench.py names them. Prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from e2e_bench import load_average
from mismatch_bench import numerics_policy


def _step_seconds(variant: str, rows: int, row_tokens: int, steps: int) -> list[float]:
    import torch

    from grpo.trainer.logprobs import float32_logits

    policy = numerics_policy("bfloat16", set(variant.split("+")))
    torch.manual_seed(0)
    ids = torch.randint(0, policy.causal_lm.config.vocab_size, (rows, row_tokens))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = policy.causal_lm.get_decoder()(input_ids=ids).last_hidden_state
        logits = float32_logits(policy.lm_head, hidden[:, :-1].flatten(0, 1))  # [rows * (T-1), V]
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].reshape(-1, 1))
        logprobs.mean().backward()
        policy.model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--row-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--variants", default="hf,vllm_eager_rounding,vllm_rounding")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    for variant in args.variants.split(","):
        load_before = load_average()
        times = _step_seconds(variant, args.rows, args.row_tokens, args.steps)
        row = {"variant": variant, "step_seconds": [round(t, 3) for t in times]}
        row |= {"rows": args.rows, "row_tokens": args.row_tokens, "load_average_before": load_before}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
