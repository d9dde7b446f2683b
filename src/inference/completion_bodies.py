"""The JSON bodies of vLLM's OpenAI-compatible routes that grpo sends, and the completion it reads
back: token ids in, sampled token ids and their logprobs out (no text round trip).

Every completion body states every sampling setting that shapes the distribution vLLM samples
from: a setting left out would take the server's default, which vLLM reads from the checkpoint's
generation_config.json unless started with `--generation-config vllm` (grpo's servers are, a server
started by hand may not be). Qwen3's says top_k 20 and top_p 0.95: the logprobs would be
renormalised over those tokens while the trainer computes over the whole vocabulary. The settings
vLLM has no server default for (logit_bias, allowed_token_ids, bad_words, structured outputs,
thinking_token_budget) are off when left out, and grpo never sets them. `--generation-config vllm`
still reads the checkpoint's end-of-sequence ids, so where a completion stops does not change.
"""

from __future__ import annotations

import base64
import io
from dataclasses import asdict
from typing import Any

import numpy as np

from grpo.inference.types import Completion, GenerateRequest, SamplingParams


def load_lora_body(name: str, path: str) -> dict[str, Any]:
    """Load (or reload in place: same name, new weights) the adapter in folder `path` as `name`."""
    return {"lora_name": name, "lora_path": path, "load_inplace": True}


def completion_from_choice(choice: dict[str, Any]) -> Completion:
    logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
    return completion_of(choice, list(choice["token_ids"]), logprobs)


def completion_of(
    choice: dict[str, Any],
    token_ids: list[int],
    logprobs: list[float],
    prompt_token_ids: list[int] | None = None,
) -> Completion:
    """A Completion from one response choice (of /v1/completions or the token-in generate route),
    given its token ids and logprobs as that route lays them out."""
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"server returned {len(token_ids)} token ids but {len(logprobs)} logprobs")
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        text=choice["text"],
        finish_reason=choice["finish_reason"],
        stop_reason=choice.get("stop_reason"),
        routed_experts=decode_routed_experts(choice["routed_experts"])
        if choice.get("routed_experts")
        else None,
        kept_counts=_kept_counts(choice["kept_counts"], len(token_ids)) if "kept_counts" in choice else None,
        prompt_token_ids=prompt_token_ids,
    )


def _kept_counts(counts: Any, num_tokens: int) -> np.ndarray:
    """grpo-infer's `kept_counts` of a choice (grpo.inference.routing_responses) -> [num_tokens] int32."""
    array = np.asarray(counts)
    if array.shape != (num_tokens,) or (array.size and (array.dtype.kind not in "iu" or array.min() < 0)):
        raise RuntimeError(f"server returned kept_counts of shape {array.shape} for {num_tokens} tokens")
    return array.astype(np.int32)


def decode_routed_experts(encoded: str) -> np.ndarray:
    """vLLM's `routed_experts` (base64 of `.npy` bytes) -> [tokens, layers, top_k] integer ids."""
    with io.BytesIO(base64.b64decode(encoded)) as buffer:
        array = np.load(buffer, allow_pickle=False)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise RuntimeError(f"server returned routed_experts of shape {array.shape} and dtype {array.dtype}")
    return array


def encode_routed_experts(routing: np.ndarray) -> str:
    """[tokens, layers, top_k] expert ids as vLLM sends `routed_experts`: base64 of `.npy` bytes
    (what grpo-infer adds to a CPU engine's choices; decode_routed_experts reads both)."""
    with io.BytesIO() as buffer:
        np.save(buffer, routing, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The sampling part of a /completions body: every field of `params`, none left to the server."""
    fields = asdict(params)
    fields["stop"] = list(params.stop)
    fields["stop_token_ids"] = list(params.stop_token_ids)
    # No watermark: vLLM applies one configured on the engine to every request that does not say no.
    return {**fields, "watermarking": False}


def completion_body(request: GenerateRequest) -> dict[str, Any]:
    """The /completions body of `request`: token ids in, sampled token ids and their logprobs out."""
    body: dict[str, Any] = {
        "model": request.model,
        "prompt": request.prompt_token_ids,
        "n": request.n,
        **sampling_fields(request.params),
        "logprobs": 0,
        "return_token_ids": True,
        **request.extra,
    }
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return body


def prompt_logprobs_body(token_ids: list[int], model: str, num_top: int = 0) -> dict[str, Any]:
    """The /completions body that scores `token_ids` under `model` (prompt logprobs, which vLLM
    computes from the raw logits), sampling one token with every setting stated all the same;
    `num_top`: also the most likely tokens at each position (-1: every token of the vocabulary)."""
    return {
        "model": model,
        "prompt": token_ids,
        **sampling_fields(SamplingParams(temperature=1.0, max_tokens=1)),
        "prompt_logprobs": num_top,
    }


def prompt_logprobs_of(response: dict[str, Any], token_ids: list[int]) -> list[float]:
    """Each prompt token's own logprob from the answer to `prompt_logprobs_body(token_ids, ...)`
    (0.0 at position 0, which nothing predicts)."""
    entries = response["choices"][0]["prompt_logprobs"]
    # Entry i maps token id -> {logprob, ...}; it always includes the prompt's own token.
    return [
        0.0 if entry is None else float(entry[str(token)]["logprob"])
        for entry, token in zip(entries, token_ids, strict=True)
    ]


def prompt_top_logprobs_of(response: dict[str, Any], num_tokens: int) -> list[dict[int, float] | None]:
    """Each position's reported tokens and logprobs from the answer to `prompt_logprobs_body` with
    `num_top`; None at position 0."""
    entries = response["choices"][0]["prompt_logprobs"]
    if len(entries) != num_tokens:
        raise RuntimeError(f"server returned prompt logprobs for {len(entries)} of {num_tokens} tokens")
    return [
        None if entry is None else {int(token): float(value["logprob"]) for token, value in entry.items()}
        for entry in entries
    ]


def chat_render_body(
    messages: list[dict[str, Any]],
    model: str,
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The /chat/completions body whose answer holds the prompt ids the server's own chat template
    renders `messages` to (`prompt_token_ids`), as grpo's ChatTokenizer.prompt_ids renders them:
    a final assistant message is continued, else a generation prompt is added. One token is
    sampled, with every setting stated."""
    prefill = bool(messages) and messages[-1].get("role") == "assistant"
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        **sampling_fields(SamplingParams(temperature=1.0, max_tokens=1)),
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "return_token_ids": True,
    }
    if tools:
        body["tools"] = tools
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    return body
