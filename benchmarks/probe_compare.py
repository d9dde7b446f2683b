"""The compare phase of benchmarks/vllm_layer_probe.py: replays each op vLLM recorded through
candidate bf16 implementations (bit-for-bit match counts), then compares the trainer's decoder
with the engine's hidden states layer by layer. No vLLM import."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

RECORDS_PER_LAYER = 9


def _steps(records: list[dict[str, Any]], num_layers: int) -> list[dict[str, Any]]:
    per_step = 2 + RECORDS_PER_LAYER * num_layers
    assert len(records) % per_step == 0, (len(records), per_step)
    keys = ["ln1", "qkv", "rope", "attn", "o", "ln2", "gate_up", "act", "down"]
    steps = []
    for s in range(len(records) // per_step):
        chunk = records[s * per_step : (s + 1) * per_step]
        step: dict[str, Any] = {"embed": chunk[0], "norm": chunk[-1], "layers": []}
        for i in range(num_layers):
            layer = chunk[1 + i * RECORDS_PER_LAYER : 1 + (i + 1) * RECORDS_PER_LAYER]
            assert [r["name"].split(".")[-1] for r in layer] == [
                "input_layernorm", "qkv_proj", "rotary_emb", "attn", "o_proj",
                "post_attention_layernorm", "gate_up_proj", "act_fn", "down_proj",
            ]  # fmt: skip
            step["layers"].append(dict(zip(keys, layer, strict=True)))
        steps.append(step)
    return steps


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) else value


def compare(probe: Path) -> None:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from grpo.models.embedded import build
    from grpo.trainer.hf.cpu_fused_ops import rotary_float32
    from grpo.trainer.hf.vllm_numerics import round_as_vllm_kernel

    data = torch.load(probe, weights_only=False)
    path = build()
    config = AutoConfig.from_pretrained(path)
    w = {k: v.to(torch.bfloat16) for k, v in load_file(str(path / "model.safetensors")).items()}
    num_layers, eps = config.num_hidden_layers, config.rms_norm_eps
    num_heads, num_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // num_heads
    steps = _steps(data["records"], num_layers)
    bf16, f32 = torch.bfloat16, torch.float32

    def norm_bf16_weight(x32: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(bf16)

    def norm_f32_weight(x32: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (weight.float() * x).to(bf16)

    inv_freq = 1.0 / (
        config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=f32) / head_dim)
    )

    def rope_bf16(x: torch.Tensor, pos: torch.Tensor, fp32: bool) -> torch.Tensor:
        freqs = pos.float()[:, None] * inv_freq[None]
        cos, sin = freqs.cos().to(bf16)[:, None], freqs.sin().to(bf16)[:, None]
        x = x.view(x.shape[0], -1, head_dim)
        if fp32:
            x, cos, sin = x.float(), cos.float(), sin.float()
        x1, x2 = x.chunk(2, -1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
        return out.to(bf16).flatten(1)

    def trainer_rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        freqs = pos.float()[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(bf16)[None], emb.sin().to(bf16)[None]
        x = x.view(1, x.shape[0], -1, head_dim).transpose(1, 2)
        return round_as_vllm_kernel(rotary_float32(x, cos, sin), bf16).transpose(1, 2).flatten(2)[0]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str) -> torch.Tensor:
        """q [T, Hq*D] for the last T positions of k, v [S, Hkv*D] -> [T, Hq*D]."""
        t, s = q.shape[0], k.shape[0]
        qh = q.view(t, num_heads, head_dim).transpose(0, 1)
        kh = k.view(s, num_kv, head_dim).transpose(0, 1).repeat_interleave(num_heads // num_kv, 0)
        vh = v.view(s, num_kv, head_dim).transpose(0, 1).repeat_interleave(num_heads // num_kv, 0)
        mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
        if kind == "sdpa_bf16":
            out = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=mask[None, None])[0]
        elif kind == "exact_f32":
            scores = (qh.float() @ kh.float().transpose(-1, -2)) * head_dim**-0.5
            p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out = (p @ vh.float()).to(bf16)
        elif kind == "p_bf16":
            scores = (qh.float() @ kh.float().transpose(-1, -2)) * head_dim**-0.5
            p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out = (p.to(bf16).float() @ vh.float()).to(bf16)
        elif kind == "trainer":
            scores = (qh.float() @ kh.float().transpose(-1, -2)) * head_dim**-0.5
            p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out = round_as_vllm_kernel(p @ vh.float(), bf16)
        else:
            raise ValueError(kind)
        return out.transpose(0, 1).reshape(t, -1)

    tally: dict[str, list[float]] = defaultdict(list)

    def count(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        tally[name].append((a.float() != b.float()).float().mean().item())

    k_hist: dict[int, list[torch.Tensor]] = defaultdict(list)
    v_hist: dict[int, list[torch.Tensor]] = defaultdict(list)
    num_prompt = len(data["prompt"])
    for s, step in enumerate(steps):
        n = step["embed"]["output"].shape[0]
        pos = torch.arange(n) if s == 0 else torch.tensor([num_prompt + s - 1])
        h0 = step["embed"]["output"]
        hidden32 = h0.float()
        residual = h0
        for i, layer in enumerate(step["layers"]):
            p = f"model.layers.{i}."
            # input norm: vLLM normalises (down + residual) of the previous layer, unrounded
            ln1 = layer["ln1"]["output"]
            normed = _first(ln1)
            count("ln1 bf16-weight", norm_bf16_weight(hidden32, w[p + "input_layernorm.weight"]), normed)
            count("ln1 f32-weight", norm_f32_weight(hidden32, w[p + "input_layernorm.weight"]), normed)
            if isinstance(ln1, (tuple, list)):
                residual = ln1[1]
                count("residual = round(f32 sum)", hidden32.to(bf16), residual)
            qkv = _first(layer["qkv"]["output"])
            wqkv = torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
            count("qkv fused F.linear", F.linear(normed, wqkv), qkv)
            count("q split F.linear", F.linear(normed, w[p + "self_attn.q_proj.weight"]), qkv[:, :576])
            q, _, v = qkv.split([num_heads * head_dim, num_kv * head_dim, num_kv * head_dim], -1)
            q_r, k_r = layer["rope"]["output"]
            count("rope bf16 ops", rope_bf16(q, pos, False), q_r)
            count("rope f32 one rounding", rope_bf16(q, pos, True), q_r)
            count("rope trainer (vllm_numerics)", trainer_rope(q, pos), q_r)
            k_hist[i].append(k_r)
            v_hist[i].append(v)
            kk, vv = torch.cat(k_hist[i]), torch.cat(v_hist[i])
            attn = layer["attn"]["output"].view(q_r.shape[0], -1)
            for kind in ("sdpa_bf16", "exact_f32", "p_bf16", "trainer"):
                count(f"attn {kind} {'prefill' if s == 0 else 'decode'}", attention(q_r, kk, vv, kind), attn)
            o = _first(layer["o"]["output"])
            count("o_proj F.linear", F.linear(attn, w[p + "self_attn.o_proj.weight"]), o)
            ln2_normed, residual2 = layer["ln2"]["output"]
            sum32 = residual.float() + o.float()
            count("residual2 = round(f32 sum)", sum32.to(bf16), residual2)
            count(
                "ln2 bf16-weight",
                norm_bf16_weight(sum32, w[p + "post_attention_layernorm.weight"]),
                ln2_normed,
            )
            gu = _first(layer["gate_up"]["output"])
            wgu = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
            count("gate_up fused F.linear", F.linear(ln2_normed, wgu), gu)
            g, u = gu.chunk(2, -1)
            act = layer["act"]["output"]
            count("act bf16 silu*mul", F.silu(g) * u, act)
            count("act f32 one rounding", (F.silu(g.float()) * u.float()).to(bf16), act)
            down = _first(layer["down"]["output"])
            count("down F.linear", F.linear(act, w[p + "mlp.down_proj.weight"]), down)
            residual = residual2
            hidden32 = residual2.float() + down.float()
        final = _first(step["norm"]["output"])
        count("final norm bf16-weight", norm_bf16_weight(hidden32, w["model.norm.weight"]), final)
    print("fraction of output elements differing from vLLM's (mean over layers and steps):")
    for name, values in tally.items():
        print(f"  {name:40s} {sum(values) / len(values):.5f}")
    _trainer_layers(data, steps, path)


def _trainer_layers(data: dict[str, Any], steps: list[dict[str, Any]], path: Path) -> None:
    """The trainer's own decoder (build_policy: LoRA on borrowed bf16 weights, autocast, vLLM
    rounding) on prompt + completion: each layer's output against the engine's, and the sampled
    tokens' logprobs against the engine's."""
    import torch
    from safetensors.torch import load_file

    from grpo.config.trainer import TrainerConfig
    from grpo.trainer.float32_logits import float32_logits
    from grpo.trainer.hf.model import build_policy
    from grpo.trainer.weights import BorrowedWeights

    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(path / "model.safetensors")).items()}
    policy = build_policy(TrainerConfig(model=str(path), lora=True), BorrowedWeights(path, weights))
    decoder = policy.causal_lm.get_decoder()
    outputs: list[torch.Tensor] = []
    for layer in decoder.layers:
        layer.register_forward_hook(lambda m, i, o: outputs.append(o[0] if isinstance(o, tuple) else o))
    ids = torch.tensor(data["prompt"] + data["completion"])[None]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = decoder(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).last_hidden_state[0]
    # the engine's layer outputs, position by position: prefill rows then one row per decode step
    print("layer: fraction of positions x features differing from the engine (max abs)")
    for i in range(len(decoder.layers)):
        engine = torch.cat(
            [
                s["layers"][i]["ln2"]["output"][1].float() + s["layers"][i]["down"]["output"][0].float()
                for s in steps
            ]
        )
        mine = outputs[i][0, : engine.shape[0]].float()
        d = (mine - engine).abs()
        if i < 4 or i % 5 == 0 or i == len(decoder.layers) - 1:
            print(f"  {i:2d}: {(d > 0).float().mean().item():.5f} ({d.max().item():.3g})")
    start, num = len(data["prompt"]), len(data["completion"])
    logits = float32_logits(policy.lm_head, hidden[start - 1 : start + num - 1])
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, start : start + num, None]).squeeze(-1)
    diff = lp.double() - torch.tensor(data["logprobs"], dtype=torch.float64)[: lp.shape[0]]
    print(f"completion logprobs: max |trainer - engine| {diff.abs().max().item():.3g} over {num} tokens")
