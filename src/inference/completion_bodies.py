"""The JSON bodies of vLLM's OpenAI-compatible routes that grpo sends, and the completion it reads
back: token ids in, sampled token ids and their logprobs out (no text round trip)."""

from __future__ import annotations

from typing import Any

from grpo.inference.types import Completion, GenerateRequest


def load_lora_body(name: str, path: str) -> dict[str, Any]:
    """Load (or reload in place: same name, new weights) the adapter in folder `path` as `name`."""
    return {"lora_name": name, "lora_path": path, "load_inplace": True}


def completion_from_choice(choice: dict[str, Any]) -> Completion:
    token_ids = list(choice["token_ids"])
    logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"server returned {len(token_ids)} token ids but {len(logprobs)} logprobs")
    return Completion(
        token_ids=token_ids, logprobs=logprobs, text=choice["text"], finish_reason=choice["finish_reason"]
    )


def completion_body(request: GenerateRequest) -> dict[str, Any]:
    """The /completions body of `request`: token ids in, sampled token ids and their logprobs out."""
    params = request.params
    body: dict[str, Any] = {
        "model": request.model,
        "prompt": request.prompt_token_ids,
        "n": request.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "stop": list(params.stop),
        "logprobs": 0,
        "return_token_ids": True,
        **request.extra,
    }
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return body
