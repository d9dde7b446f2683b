"""A local TCP port held for a server that binds it later, in this process or a child.

A port only probed (bound to 0, then closed) stays free for whoever asks next, and the server that
needs it binds seconds to tens of seconds later: after engines have started and HTTP clients have
opened connections, each taking a port by bind(0) or connect(). Held instead by a socket bound with
SO_REUSEADDR and never listening, the port goes to no other bind(0), connection or plain bind,
while a server socket that sets SO_REUSEADDR too (torch's TCPStore, vLLM's API server) can still
bind and listen on it: Linux lets SO_REUSEADDR sockets share a port as long as none of the others
listens.
"""

from __future__ import annotations

import socket


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket holding a free port on `host` (an IPv4 or IPv6 address) until the caller closes it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock
