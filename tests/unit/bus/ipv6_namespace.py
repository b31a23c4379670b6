"""Run by ``test_tcp_peer_keys.py`` inside a network namespace of its own (``unshare
-rn``) whose ``lo`` holds 2001:db8:1:2::1, ::2 and ::3 (one /64) and
2001:db8:1:3::2 (another): real connections from two addresses of one /64, which
the host's own loopback (``::1`` alone) cannot make.  It drives the descriptor
guard's pass and the ZAP handler through them and prints what they did as JSON,
for the test to check.  Not collected by pytest (no ``test_`` prefix)."""

from __future__ import annotations

import json
import socket
import sys
from contextlib import ExitStack
from typing import Any

import structlog.testing
import zmq

from inferd.bus.access import AccessPolicy
from inferd.bus.descriptor_scan import _Pass, end_extra_connections
from inferd.bus.endpoint_connections import EndpointConnections
from inferd.bus.zap import SocketSecurity, ZapHandler, peer_of
from inferd.config import SecurityConfig
from tests.conftest import HANG_S, wait_until

SERVER = "2001:db8:1:2::1"
SAME_64 = ("2001:db8:1:2::2", "2001:db8:1:2::3")
OTHER_64 = "2001:db8:1:3::2"
#: Every address the namespace's ``lo`` must hold.
ADDRESSES = (SERVER, *SAME_64, OTHER_64)


def _at_end(sock: socket.socket) -> bool:
    """Whether ``sock`` reads its end now (its peer shut it down)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False  # open, nothing to read


def guard_pass() -> dict[str, Any]:
    """Raw accepted connections stand for libzmq's (as in test_descriptor_guard.py):
    one from ::2, two from ::3, one from the other /64, then a pass keeping 2 a peer,
    and one holding all peers to a target of 2."""
    with ExitStack() as stack:
        listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        stack.callback(listener.close)
        listener.bind((SERVER, 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        sockets = {"t": EndpointConnections(f"tcp://[{SERVER}]:{port}")}
        clients: list[socket.socket] = []
        accepted: list[socket.socket] = []
        for source in (SAME_64[0], SAME_64[1], SAME_64[1], OTHER_64):
            client = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            stack.callback(client.close)
            client.bind((source, 0))
            client.connect((SERVER, port))
            conn, _ = listener.accept()
            stack.callback(conn.close)
            clients.append(client)
            accepted.append(conn)
        scan = _Pass(sockets)
        holds = {
            key: scan.holds(accepted[2].fileno(), ("t", key))
            for key in ("2001:db8:1:2::/64", "2001:db8:1:3::/64", SAME_64[1])
        }
        bound = end_extra_connections(sockets, 2)

        def ended() -> list[int]:
            return [index for index, client in enumerate(clients) if _at_end(client)]

        # The ends travel over lo: wait for as many as the pass counted.
        wait_until(lambda: len(ended()) == bound.total(), HANG_S)
        ended_past_bound = ended()
        shared = end_extra_connections(sockets, 5, target=2)
        return {
            "holds": holds,
            "past_bound": [[*peer, n] for peer, n in bound.past_bound.items()],
            "ended_past_bound": ended_past_bound,
            "past_share": [[*peer, n] for peer, n in shared.past_share.items()],
            "share": shared.share,
        }


def zap_handshakes() -> dict[str, Any]:
    """A real ZAP handler holding each peer to one connection of a tcp ROUTER: a
    DEALER from ::2, then one from ::3 (the same /64: refused), then one from the
    other /64; what got in, and the refusals."""
    context: zmq.Context[Any] = zmq.Context()
    sockets = SocketSecurity()
    transports = {"infer": "tcp", "control": "tcp", "events": "tcp"}
    handler = ZapHandler(context, AccessPolicy(SecurityConfig(), transports, {}), sockets, 1)
    handler.start()
    handler.wait_bound(HANG_S)
    received: list[list[Any]] = []
    clients: list[zmq.Socket[Any]] = []
    server = context.socket(zmq.ROUTER)
    try:
        server.setsockopt(zmq.IPV6, 1)
        sockets.apply("control", server)
        server.bind(f"tcp://[{SERVER}]:0")
        sockets.bound("control", server)
        port = server.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]

        def send_from(source: str, text: bytes) -> None:
            client = context.socket(zmq.DEALER)
            clients.append(client)
            client.setsockopt(zmq.IPV6, 1)
            client.connect(f"tcp://[{source}]:0;[{SERVER}]:{port}")
            client.send(text)

        def served() -> None:
            assert server.poll(int(HANG_S * 1000)), "no message"
            frame = server.recv_multipart(copy=False)[-1]
            peer = peer_of(frame)
            assert peer is not None
            received.append([frame.bytes.decode(), peer.address, peer.key, peer.describe()])

        with structlog.testing.capture_logs() as logs:
            send_from(SAME_64[0], b"first")
            served()
            send_from(SAME_64[1], b"second")
            # Refused, or (counted by address) served: whichever comes.
            wait_until(lambda: handler.describe()["refused"] or server.poll(0), HANG_S)
            if server.poll(0):
                served()
            send_from(OTHER_64, b"third")
            served()
        refusals = [entry["reason"] for entry in logs if entry["event"] == "peer_refused"]
        return {"received": received, "counters": dict(handler.describe()), "refusals": refusals}
    finally:
        for sock in [*clients, server]:
            sock.close(linger=0)
        handler.stop()
        handler.join(HANG_S)
        context.destroy(linger=0)


if __name__ == "__main__":
    json.dump({"guard": guard_pass(), "zap": zap_handshakes()}, sys.stdout)
