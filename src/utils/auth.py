"""Shared secrets for the network endpoints grpo opens (ZMQ batches, the environment server).

A secret is read from an environment variable, never from a YAML file that gets copied into the
run directory. Binding anything but a loopback address without one is refused at load: any host
that reaches the port could otherwise stop or poison training.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os

TAG_BYTES = hashlib.sha256().digest_size


def is_loopback_host(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or a wildcard such as '*': may be reachable from elsewhere


def secret_from_env(var: str | None) -> bytes | None:
    """The secret in `$var` (None when no variable is named or it is unset or empty)."""
    if not var:
        return None
    value = os.environ.get(var, "")
    return value.encode() if value else None


def open_without_secret(host: str, var: str | None) -> bool:
    """Whether an endpoint at `host` would be reachable from other machines with no secret in
    `$var`: the combination every grpo server and sender refuses at load."""
    return not is_loopback_host(host) and secret_from_env(var) is None


def sign(secret: bytes, payload: bytes) -> bytes:
    """HMAC-SHA256 tag of `payload` (TAG_BYTES long)."""
    return hmac.new(secret, payload, hashlib.sha256).digest()


def verify(secret: bytes, payload: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(sign(secret, payload), tag)
