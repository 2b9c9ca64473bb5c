"""The resident connector engines' harness side without an engine: each engine's side-channel port
(where a handshake connector such as NIXL listens for its peer) is one nothing listens on."""

from __future__ import annotations

import socket

from qualify.engines.connector_session import free_port


def test_a_side_channel_port_is_free_to_listen_on():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
