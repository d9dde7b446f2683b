"""Credentials out of what grpo logs elsewhere (W&B's run config): URL passwords and secret fields.

A config is mostly harmless settings, but free-form parts of it (env args, judge and env server
URLs) can hold `user:password@host` URLs, `?token=` query values or keys a user pasted in. W&B
copies the config to its servers and into every teammate's browser, so those go out as `***`.
Names of environment variables (`api_key_var`, `api_key_env`, ...) are not secrets and stay:
a key is secret by how its name ends.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"

_SECRET_KEY = re.compile(
    r"(^|[_-])(api[_-]?key|private[_-]?key|token|secret|password|passwd|authorization|credentials?)$", re.I
)
"""`api_key`, `hf_token`, `password`, ...; not `max_tokens` or `token_mask_low`, which are sizes."""
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)


def is_secret_key(key: str) -> bool:
    """Whether a mapping key's value is a secret itself (not the name of where one is kept)."""
    return bool(_SECRET_KEY.search(key))


def redact_url(url: str) -> str:
    """`url` with its password (userinfo) and secret-looking query values replaced."""
    if not _URL.match(url):
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:{REDACTED}@{host}" if ":" in userinfo else f"{REDACTED}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, REDACTED if is_secret_key(k) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(value: Any) -> Any:
    """A copy of a JSON-like tree (dicts, lists, scalars) with secrets replaced by `***`."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_key(k) and v not in (None, "") else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_url(value)
    return value
