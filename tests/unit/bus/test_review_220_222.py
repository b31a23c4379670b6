"""Review of entry 220 (an IPv6 tcp peer counted as its /64).

* libzmq names a link-local IPv6 peer with its zone (``Peer-Address``
  ``fe80::1%lo``, from ``getnameinfo``), Python's ``getpeername`` without it
  (``fe80::1``, the scope id apart).  ``tcp_peer_key`` drops the zone, so
  ``count_from`` counts such a peer; ``close_from`` still compares the very text,
  so the events socket's ending of a subscriber that sent a refused subscription
  (``subscribers.py``, DESIGN.md 124) ends none of a link-local peer's connections.
* The ZAP handler counts every peer, a CURVE-authenticated one included, by its
  address's key: the connections any host of its /64 holds (handshaking ones, no
  key needed) refuse it, though entry 220 says each CURVE key is a peer of its own.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus.access import AccessPolicy
from inferd.bus.endpoint_connections import EndpointConnections
from inferd.bus.zap import SocketSecurity, ZapHandler
from inferd.config import SecurityConfig
from tests.unit.bus.test_tcp_peer_keys import _namespace_or_skip

REPO = Path(__file__).resolve().parents[3]

#: Run inside ``unshare -rn`` with ``fe80::1/64`` on ``lo``: a ROUTER on the
#: link-local address, a DEALER connected to it, and what ``EndpointConnections``
#: makes of the ``Peer-Address`` libzmq gives the message.
_SCRIPT = """
import json, zmq
from inferd.bus.endpoint_connections import EndpointConnections
context = zmq.Context()
router = context.socket(zmq.ROUTER)
router.setsockopt(zmq.IPV6, 1)
router.setsockopt(zmq.RCVTIMEO, 10_000)
router.bind("tcp://[fe80::1%lo]:*")
endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
dealer = context.socket(zmq.DEALER)
dealer.setsockopt(zmq.IPV6, 1)
dealer.setsockopt(zmq.LINGER, 0)
dealer.connect(endpoint)
dealer.send(b"subscription no topic matches")
frames = router.recv_multipart(copy=False)
address = frames[1].get("Peer-Address")
connections = EndpointConnections(endpoint)
found = {"address": address, "counted": connections.count_from(address)}
found["closed"] = connections.close_from(address)
print(json.dumps(found))
dealer.close()
router.close(linger=0)
context.term()
"""


def in_a_namespace(setup: str, code: str, unavailable: str) -> dict[str, Any]:
    """Run ``code`` (Python printing one JSON line last) in a user and network namespace
    of its own, after the shell commands ``setup``; skipped with ``unavailable`` when
    the namespace cannot be set up so.  Its last line, parsed."""
    _namespace_or_skip()
    script = f'{setup} || exit 77; exec "$0" -c "$1"'
    done = subprocess.run(
        ["unshare", "-rn", "sh", "-c", script, sys.executable, code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    if done.returncode == 77:
        pytest.skip(f"{unavailable}: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_close_from_ends_a_link_local_peers_connection_named_as_libzmq_names_it() -> None:
    found = in_a_namespace(
        "ip link set lo up && ip -6 addr add fe80::1/64 dev lo nodad",
        _SCRIPT,
        "no IPv6 link-local address on a namespace's lo",
    )
    assert found["address"] == "fe80::1%lo"  # libzmq's text, with the zone
    assert found["counted"] == 1  # count_from goes through tcp_peer_key: zone dropped
    assert found["closed"] == 1, "close_from ended none of the link-local peer's connections"


# -- a CURVE peer counted with every connection of its /64 --------------------------

GROUND = bytes(range(32))


def test_zap_does_not_refuse_a_curve_peer_for_connections_others_of_its_64_hold() -> None:
    """``bus.max_connections`` 1.  Two plain TCP connections from ``::1`` that never
    finish a handshake (any host of the link can open them: no key needed; each
    lives ``HANDSHAKE_TIMEOUT_MS`` and is opened again) and then a CURVE handshake
    with an allow-listed key from ``::2``, another address of the same /64.  Entry
    220 says each CURVE key is a peer of its own whatever its address; the handler
    refused it for the others' connections (before 220: admitted, its own address
    holding none)."""
    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    with ExitStack() as stack:
        stack.callback(listener.close)
        listener.bind(("::1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        sockets = SocketSecurity()
        sockets.connections["control"] = EndpointConnections(f"tcp://[::1]:{port}")
        transports = {"infer": "tcp", "control": "tcp", "events": "tcp"}
        policy = AccessPolicy(SecurityConfig(curve=True), transports, {GROUND: "ground"})
        handler = ZapHandler(zmq.Context.instance(), policy, sockets, 1)
        for _ in range(2):
            client = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            stack.callback(client.close)
            client.connect(("::1", port))
            stack.callback(listener.accept()[0].close)
        request = [b"1.0", b"1", b"control", b"::2", b"", b"CURVE", GROUND]
        reply = handler.answer(request)
        assert reply[2:4] == [b"200", b"OK"], reply[3].decode()
