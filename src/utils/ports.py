"""A local TCP port held for a server that binds it later, in this process or a child.

A port only probed (bound to 0, then closed) stays free for whoever asks next, and the server that
needs it binds seconds to tens of seconds later: after engines have started and HTTP clients have
opened connections, each taking a port by bind(0) or connect(). A held port goes to no other
bind(0), connection or plain bind. Two ways to hold it, by what the server's own socket sets:

- `for_reuse_port` (the inference server, whose socket grpo asks vLLM to make with SO_REUSEPORT):
  the hold sets SO_REUSEPORT alone. Linux then lets a socket bind the port only if it sets
  SO_REUSEPORT too and belongs to the same user, so another local user can take it neither while
  the server starts nor between its restarts (SO_REUSEADDR or not, wildcard address or not), and
  connections go to the one socket that listens.
- otherwise (torch's TCPStore, which sets SO_REUSEADDR and not SO_REUSEPORT): the hold sets
  SO_REUSEADDR and never listens; Linux lets SO_REUSEADDR sockets share a port as long as none of
  the others listens. Another local user's SO_REUSEADDR socket could bind it too, so this hold
  keeps the port from accidents, not from other users of the machine (docs/security.md).
"""

from __future__ import annotations

import socket

HELD_PORT_ENV = "GRPO_HELD_PORT"
"""Set by a process that holds a server's port (for_reuse_port) for the server process it starts:
the server binds that port with SO_REUSEPORT, the only way past the hold."""


def reserve_port(host: str = "127.0.0.1", for_reuse_port: bool = False) -> socket.socket:
    """A socket holding a free port on `host` (an IPv4 or IPv6 address) until the caller closes it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT if for_reuse_port else socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    return sock
