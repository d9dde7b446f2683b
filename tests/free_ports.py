"""A free local TCP port for a test's server, probed and released so that the server binds it next.

The port is drawn below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range).
Between the probe and the server's bind, seconds to minutes may pass in which vLLM engines,
torch stores and HTTP clients, this test's and the other xdist worker's, take ports by bind(0)
and connect(); those come only from the ephemeral range, so none of them can take a port drawn
below it. Only another explicit bind could, and a draw at random among ~10,000 ports makes two
tests' picks meeting rare. grpo's own co-located store holds its port instead
(grpo.colocate.replicas.reserve_port), which a test's separate processes cannot do.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Below 10000 sit the well-known and registered services a test machine might run.
LOWEST_PORT = 10_000
_drawn: set[int] = set()
# Its own source of randomness: a plugin reseeding `random` for each test would otherwise give
# both xdist workers the same sequence of ports.
_random = random.SystemRandom()


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out by itself (bind to 0, connect)."""
    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    return int(range_file.read_text().split()[0]) if range_file.exists() else 32768


def free_port() -> int:
    """A port no socket here holds, below the ephemeral range, never the same twice a process."""
    ceiling = ephemeral_port_floor()
    if ceiling - LOWEST_PORT < 1000:
        # An ephemeral range reaching this low leaves no room outside it: take the kernel's pick.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])
    for _ in range(200):
        port = _random.randrange(LOWEST_PORT, ceiling)
        if port in _drawn:
            continue
        # Binding the wildcard address fails if any address holds the port, 127.0.0.1 included.
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
        _drawn.add(port)
        return port
    raise RuntimeError(f"no free TCP port found in [{LOWEST_PORT}, {ceiling})")
