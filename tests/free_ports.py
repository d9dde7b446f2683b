"""A free local TCP port for a test's server: probed and released, so the server binds it next.

Good enough for a test that binds at once; grpo's own co-located store holds its port instead
(grpo.colocate.replicas.reserve_port), because it binds tens of seconds later."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
