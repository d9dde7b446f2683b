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
from urllib.parse import urlsplit

from grpo.utils.errors import UserError

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


MIN_SECRET_CHARS = 16
"""Shortest secret or key accepted. 16 random characters (e.g. `secrets.token_urlsafe(16)`, ~95
bits) are out of reach of online guessing and of brute-forcing an HMAC tag offline, while a short
value is most often a placeholder ("secret", "test", a space) an attacker tries first."""

GENERATE_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def secret_from_env(var: str | None) -> bytes | None:
    """The secret in `$var` (None when no variable is named or it is unset or empty).

    Every secret and key grpo reads (batch and weight secrets, the env server token, the
    inference API key) comes through here, so a weak one is refused wherever it is used."""
    if not var:
        return None
    value = os.environ.get(var, "")
    if not value:
        return None
    check_secret(value, f"${var}")
    return value.encode()


def check_secret(value: str, what: str) -> None:
    """Raise UserError naming `what` when `value` is whitespace only or shorter than MIN_SECRET_CHARS
    (leading and trailing whitespace not counted)."""
    if not value.strip():
        raise UserError(f"{what} is only whitespace; set it to a random string ({GENERATE_HINT}) or unset it")
    if len(value.strip()) < MIN_SECRET_CHARS:
        raise UserError(
            f"{what} has {len(value.strip())} characters; a secret needs at least {MIN_SECRET_CHARS}: "
            f"set it to a random string ({GENERATE_HINT})"
        )


def open_without_secret(host: str, var: str | None) -> bool:
    """Whether an endpoint at `host` would be reachable from other machines with no secret in
    `$var`: the combination every grpo server and sender refuses at load. A weak secret is refused
    (UserError) on any host: set but weak is a mistake, not a choice."""
    return secret_from_env(var) is None and not is_loopback_host(host)


def sign(secret: bytes, payload: bytes) -> bytes:
    """HMAC-SHA256 tag of `payload` (TAG_BYTES long)."""
    return hmac.new(secret, payload, hashlib.sha256).digest()


def verify(secret: bytes, payload: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(sign(secret, payload), tag)


_warned_plaintext: set[str] = set()


def warn_if_plaintext_token(url: str, what: str) -> None:
    """Warn once per server when a bearer token would travel to another machine in clear text
    (http:// or ws://): anyone on the path can read it and replay it. Loopback and TLS are quiet."""
    from grpo.utils.logging import get_logger

    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme in ("https", "wss") or is_loopback_host(parts.hostname or ""):
        return
    server = (
        f"{parts.scheme}://{parts.hostname}:{parts.port}"
        if parts.port
        else f"{parts.scheme}://{parts.hostname}"
    )
    if server in _warned_plaintext:
        return
    _warned_plaintext.add(server)
    get_logger("security").warning(
        "%s: the bearer token goes to %s in clear text (%s); put the server behind TLS (https/wss) or "
        "keep it on a network only the run's hosts reach",
        what,
        server,
        parts.scheme,
    )
