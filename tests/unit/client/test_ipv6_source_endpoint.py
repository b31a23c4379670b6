"""``ZMQ_IPV6`` is set for an IPv6 literal wherever it stands in a tcp:// endpoint,
also after a connect's source address (``tcp://SOURCE;[::1]:PORT``, DESIGN.md 173):
without it libzmq's tcp socket is IPv4 only and never reaches the daemon.  A
wildcard or a host name stays IPv4 (the access lists see the peers they saw)."""

from __future__ import annotations

from typing import Any

import pytest
import zmq

from inferd_client.endpoint_trust import connect
from inferd_wire.endpoints import wants_ipv6
from tests.conftest import HANG_S


@pytest.mark.parametrize(
    ("endpoint", "ipv6"),
    [
        ("tcp://[::1]:5555", True),
        ("tcp://lo:0;[::1]:5555", True),
        ("tcp://127.0.0.1:5555", False),
        ("tcp://*:5555", False),
        ("tcp://localhost:5555", False),
        ("ipc:///run/inferd/infer.sock", False),
    ],
)
def test_only_an_ipv6_literal_wants_ipv6(endpoint: str, ipv6: bool) -> None:
    assert wants_ipv6(endpoint) is ipv6


def test_a_client_with_a_source_address_reaches_an_ipv6_daemon() -> None:
    with zmq.Context() as context:
        daemon: zmq.Socket[Any] = context.socket(zmq.ROUTER)
        client: zmq.Socket[Any] = context.socket(zmq.DEALER)
        try:
            daemon.setsockopt(zmq.IPV6, True)
            daemon.bind("tcp://[::1]:0")
            port = daemon.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
            connect(client, f"tcp://lo:0;[::1]:{port}")  # from the loopback interface
            client.send(b"ping")
            assert daemon.poll(int(HANG_S * 1000)), "the client never reached [::1]"
            assert daemon.recv_multipart()[-1] == b"ping"
        finally:
            client.close(linger=0)
            daemon.close(linger=0)
