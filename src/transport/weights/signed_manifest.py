"""An update's manifest in the collective's store, signed: the sender writes its tag (HMAC over the
session nonce, the update's index and the document) before the document, and a receiver takes the
document only if the tag verifies (with a secret), it fits the served model (check_manifest) and it
names one digest per bucket (grpo.transport.weights.collective checks each bucket against it as it
arrives). No pickle: the document is JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from grpo.transport.weights.buckets import Bucket, bucket_layout, tensor_bytes
from grpo.transport.weights.collective_endpoint import tag_bytes
from grpo.transport.weights.manifest import check_manifest
from grpo.utils.auth import sign, verify

if TYPE_CHECKING:
    import torch


def manifest_payload(session_nonce: str, update: int, text: str) -> bytes:
    """What an update's tag signs: the document, bound to this session by the sender's nonce and
    to its place in the session."""
    return json.dumps(["manifest", session_nonce, update, text]).encode()


def publish_manifest(store: Any, secret: bytes | None, session_nonce: str, update: int, text: str) -> None:
    """Write update `update`'s document, its tag first: receivers read both once the document is there."""
    key = f"update/{update}"
    tag = b"" if secret is None else sign(secret, manifest_payload(session_nonce, update, text))
    store.set(f"{key}/tag", tag.hex())
    store.set(key, text)


def read_manifest(
    store: Any,
    update: int,
    *,
    timeout: float,
    secret: bytes | None,
    session_nonce: str,
    expected: Mapping[str, Sequence[int]] | None,
    who: str,
    secret_env: str,
) -> tuple[int, list[tuple[str, torch.dtype, list[int]]], list[Bucket], list[str]]:
    """Wait for update `update`'s document and check it: (policy step, its tensors, their bucket
    layout, one digest per bucket). `who` names the receiver in errors."""
    import torch.distributed as dist

    key = f"update/{update}"
    try:
        store.wait([key], timedelta(seconds=timeout))
        text = store.get(key).decode()
        tag_key = f"{key}/tag"  # written before the document by the trainer; another writer may omit it
        tag = store.get(tag_key).decode() if store.check([tag_key]) else ""
    except dist.DistError as err:  # a get waits too: for a key that another peer deleted after the wait
        raise TimeoutError(
            f"{who}: update {update} could not be read within {timeout}s: the sender (trainer) stopped sending, "
            "or a peer other than it deleted the update from the store; make the weight_broadcast port "
            "reachable only by the run's hosts (docs/security.md)"
        ) from err
    if secret is not None and not verify(
        secret, manifest_payload(session_nonce, update, text), tag_bytes(tag)
    ):
        raise ValueError(
            f"{who}: update {update}'s manifest is not signed with the secret in ${secret_env}; a peer other "
            "than the trainer wrote it, so it is refused"
        )
    manifest = json.loads(text)
    step, entries = check_manifest(manifest, expected)
    bucket_bytes = manifest.get("bucket_bytes")
    if type(bucket_bytes) is not int or bucket_bytes < 1:
        raise ValueError(f"weight update {update}'s manifest has no bucket_bytes >= 1")
    layout = bucket_layout([tensor_bytes(dtype, shape) for _name, dtype, shape in entries], bucket_bytes)
    digests = manifest.get("bucket_digests")
    if not (
        isinstance(digests, list) and len(digests) == len(layout) and all(isinstance(d, str) for d in digests)
    ):
        raise ValueError(
            f"weight update {update}'s manifest does not give one digest per bucket ({len(layout)})"
        )
    return step, entries, layout, digests
