"""A reserved port is refused to every other socket but the server it is held for."""

from __future__ import annotations

import datetime
import os
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

    held = reserve_port(for_reuse_port=True)
    port = held.getsockname()[1]
    try:
        for _restart in range(2):  # a supervised server restarted binds the same held port again
            server = create_server_socket(("127.0.0.1", port), reuse_port=True)
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


def _bind_as_another_user(port: int, options: tuple[int, ...], host: str) -> str:
    """Try to bind and listen on `port` from a child process running as user nobody."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        outcome = b"bound"
        try:
            os.setuid(65534)
            with socket.socket() as impostor:
                for option in options:
                    impostor.setsockopt(socket.SOL_SOCKET, option, 1)
                impostor.bind((host, port))
                impostor.listen()
        except OSError as error:
            outcome = f"refused: {error}".encode()
        os.write(write_end, outcome)
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        return pipe.read().decode()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
@pytest.mark.parametrize(
    "options",
    [(), (socket.SO_REUSEADDR,), (socket.SO_REUSEPORT,), (socket.SO_REUSEADDR, socket.SO_REUSEPORT)],
    ids=["plain", "reuseaddr", "reuseport", "both"],
)
def test_another_user_cannot_take_a_port_held_for_the_inference_server(
    options: tuple[int, ...], host: str
) -> None:
    held = reserve_port(for_reuse_port=True)
    try:
        assert _bind_as_another_user(held.getsockname()[1], options, host).startswith("refused")
    finally:
        held.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_the_stores_reuseaddr_hold_is_the_weaker_one_the_security_page_names() -> None:
    held = reserve_port()
    try:
        assert _bind_as_another_user(held.getsockname()[1], (socket.SO_REUSEADDR,), "127.0.0.1") == "bound"
    finally:
        held.close()
