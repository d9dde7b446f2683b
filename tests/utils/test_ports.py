"""A reserved port is refused to every other socket but the server it is held for."""

from __future__ import annotations

import datetime
import socket

import pytest

from grpo.utils.ports import reserve_port


def test_a_reserved_port_is_refused_to_a_plain_bind() -> None:
    held = reserve_port()
    try:
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", held.getsockname()[1]))
    finally:
        held.close()


def test_the_trainer_groups_store_binds_and_serves_on_the_reserved_port() -> None:
    from torch.distributed import TCPStore

    held = reserve_port()
    try:
        store = TCPStore("127.0.0.1", held.getsockname()[1], 1, True, timeout=datetime.timedelta(seconds=10))
        store.set("rank0", "here")
        assert store.get("rank0") == b"here"
    finally:
        held.close()


def test_a_server_socket_made_as_vllms_listens_on_the_reserved_port_again_after_a_restart() -> None:
    from vllm.entrypoints.launchers.launcher import create_server_socket

    held = reserve_port()
    port = held.getsockname()[1]
    try:
        for _restart in range(2):  # a supervised server restarted binds the same held port again
            server = create_server_socket(("127.0.0.1", port), reuse_port=False)
            server.listen()
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                connection, _ = server.accept()
                connection.close()
            server.close()
    finally:
        held.close()


def test_an_ipv6_host_gets_an_ipv6_port() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        held = reserve_port("::1")
    except OSError as error:
        pytest.skip(f"no IPv6 loopback here: {error}")
    try:
        assert held.family == socket.AF_INET6 and held.getsockname()[1] > 0
    finally:
        held.close()
