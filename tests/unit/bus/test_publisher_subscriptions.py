"""The events socket bounds what its subscribers send (DESIGN.md 124): a message
over ``SUBSCRIBER_MAX_MESSAGE_BYTES`` ends its connection, only subscriptions that
can match a topic are applied, and anything else is refused, counted and ends the
sending peer's connections; subscribers by topic, by prefix and to everything
still get their events.

Real ZeroMQ sockets on an ``ipc://`` endpoint; a refused subscriber runs in a
child process, since a refusal ends every events connection of its process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus.endpoint_connections import EndpointConnections
from inferd.bus.publisher import (
    SUBSCRIBABLE,
    SUBSCRIBER_MAX_MESSAGE_BYTES,
    TOPICS,
    EventPublisher,
)
from inferd_wire.protocol import unpack_header
from tests.conftest import HANG_S, wait_until
from tests.events_peers import (
    ChildSubscriber,
    closed_by_peer,
    long_frame_header,
    send_until_closed,
    zmtp_connect,
)

WAIT_MS = int(HANG_S * 1000)


def _xsub(context: zmq.Context[Any], endpoint: str, *prefixes: bytes) -> zmq.Socket[Any]:
    """An XSUB (which filters nothing itself: it gets exactly what the publisher
    sends it) subscribed to ``prefixes``."""
    sock = context.socket(zmq.XSUB)
    sock.connect(endpoint)
    for prefix in prefixes:
        sock.send(b"\x01" + prefix)
    return sock


def _topics_until(sock: zmq.Socket[Any], last: str, since_ns: int = 0) -> list[str]:
    """The topics ``sock`` receives up to the first ``last`` event stamped after
    ``since_ns`` (a ``time.time_ns()``)."""
    topics: list[str] = []
    while True:
        assert sock.poll(WAIT_MS), f"no {last} event"
        topic, payload = sock.recv_multipart()
        topics.append(topic.decode())
        if (
            topic.decode() == last
            and unpack_header(payload, check_version=False)["ts_ns"] > since_ns
        ):
            return topics


def _settle(sock: zmq.Socket[Any], since_ns: int) -> set[str]:
    """The topics of what ``sock`` gets until the second health event stamped after
    ``since_ns``: queued events go out in order, and a health event at most every
    interval, so the first may overtake an event queued before ``since_ns``, the
    second cannot (as ``tests.conftest.Events.settle``)."""
    return set(_topics_until(sock, "health", since_ns) + _topics_until(sock, "health", since_ns))


def test_subscribable_are_the_prefixes_of_the_topics_frames() -> None:
    assert b"" in SUBSCRIBABLE  # every topic
    assert {b"h", b"he", b"health", b"therm", b"runtime", b"b", b"alert"} <= SUBSCRIBABLE
    assert not {b"healthy", b"health ", b"x", b"Health", b"build\x00"} & SUBSCRIBABLE
    assert len(SUBSCRIBABLE) == 1 + sum(map(len, TOPICS))  # no two topics share a first letter
    assert max(map(len, SUBSCRIBABLE)) + len(b"\x09SUBSCRIBE") < SUBSCRIBER_MAX_MESSAGE_BYTES


def test_subscribers_by_topic_prefix_and_everything_get_their_events(
    publisher: EventPublisher, context: zmq.Context[Any], endpoint: str
) -> None:
    everything = _xsub(context, endpoint, b"")
    build = _xsub(context, endpoint, b"build", b"health")
    prefix = _xsub(context, endpoint, b"he")
    sub = context.socket(zmq.SUB)  # the clients' socket: subscribes with ZMTP 3.1 commands
    sub.subscribe(b"runtime")
    sub.subscribe(b"health")
    sub.connect(endpoint)
    for sock in (everything, build, prefix, sub):
        _topics_until(sock, "health")  # joined
    since_ns = time.time_ns()
    publisher.publish("runtime", {"n": 1})
    publisher.publish("build", {"n": 2})
    publisher.publish("alert", {"n": 3})
    assert _settle(everything, since_ns) == {"runtime", "build", "alert", "health"}
    assert _settle(build, since_ns) == {"build", "health"}
    assert _settle(prefix, since_ns) == {"health"}
    assert _settle(sub, since_ns) == {"runtime", "health"}
    # An unsubscription is applied for that connection only.  The publisher takes a
    # connection's messages in order: once an alert subscribed after the
    # unsubscription arrives, every later event is sent with both applied.
    build.send(b"\x00health")
    build.send(b"\x01alert")
    received: list[bytes] = []

    def alert_arrived() -> bool:
        publisher.publish("alert", {"n": 4})
        while build.poll(0):
            received.append(build.recv_multipart()[0])
        return b"alert" in received

    wait_until(alert_arrived, message="the alert subscribed after the unsubscription")
    # Two health events go out meanwhile: to the other connections, not to this one.
    assert "health" in _settle(everything, time.time_ns())
    publisher.publish("build", {"n": 5})
    after: list[bytes] = []
    while not after or after[-1] != b"build":
        assert build.poll(WAIT_MS), f"no build event; got {after}"
        after.append(build.recv_multipart()[0])
    assert set(after) <= {b"alert", b"build"}, after  # no health event in between
    assert publisher.subscriptions_refused == 0


@pytest.mark.parametrize(
    ("message", "why"),
    [
        (b"\x01bogus", "no topic starts so"),
        (b"\x01healthy", "longer than any topic's frame"),
        (b"\x01" + bytes(range(200)), "binary"),
        (b"hello", "no subscription (an XSUB's message)"),
    ],
)
def test_a_refused_message_is_counted_and_ends_its_peers_connections(
    publisher: EventPublisher, context: zmq.Context[Any], endpoint: str, message: bytes, why: str
) -> None:
    good = _xsub(context, endpoint, b"health")
    _topics_until(good, "health")
    with ChildSubscriber(endpoint, message) as child:
        assert child.disconnected(), f"a message that is {why} did not end its connection"
        wait_until(lambda: publisher.subscriptions_refused >= 1, message="the refusal counted")
        # The publisher goes on: this process's connection was not closed.
        assert _settle(good, time.time_ns()) == {"health"}
        assert child.received() == 0
    assert publisher.is_alive()


def test_a_message_over_the_bound_ends_its_connection(
    publisher: EventPublisher, context: zmq.Context[Any], endpoint: str
) -> None:
    good = _xsub(context, endpoint, b"health")
    _topics_until(good, "health")
    raw = zmtp_connect(endpoint)
    # The review's message: one 16 MiB subscription; read, it grew the daemon by 770 MiB.
    size = 16 << 20
    taken = send_until_closed(raw, long_frame_header(size) + b"\x01" + b"a" * (size - 1))
    assert closed_by_peer(raw)
    raw.close()
    assert taken < size  # closed at the frame's header, not after reading it
    assert _settle(good, time.time_ns()) == {"health"}
    assert publisher.subscriptions_refused == 0  # libzmq's doing: the thread never saw it


def test_a_message_at_the_bound_is_taken(
    publisher: EventPublisher, context: zmq.Context[Any], endpoint: str
) -> None:
    raw = zmtp_connect(endpoint)
    body = b"\x01" + b"h" * (SUBSCRIBER_MAX_MESSAGE_BYTES - 1)  # refused, yet not oversized
    raw.sendall(long_frame_header(len(body)) + body)
    wait_until(lambda: publisher.subscriptions_refused == 1, message="the refusal counted")
    raw.close()


def test_peer_connections_closes_only_that_processs_connections_on_the_path(
    short_tmp_path: Path,
) -> None:
    path = str(short_tmp_path / "s.sock")
    other_path = str(short_tmp_path / "other.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    other_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other_listener.bind(other_path)
    other_listener.listen()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys\n"
            "for path in sys.argv[1:]:\n"
            "    s = socket.socket(socket.AF_UNIX); s.connect(path); s.sendall(b'x')\n"
            "sys.stdin.read()",
            path,
            other_path,
        ],
        stdin=subprocess.PIPE,
    )
    try:
        from_child, _ = listener.accept()
        from_child_elsewhere, _ = other_listener.accept()
        mine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.connect(path)
        from_me, _ = listener.accept()
        connections = EndpointConnections(f"ipc://{path}")
        uid, gid = os.getuid(), os.getgid()
        assert connections.close_from(f"localhost:{uid}:{gid}:{child.pid}") == 1
        assert from_child.recv(8) == b"x" and from_child.recv(8) == b""  # shut down
        assert from_child_elsewhere.recv(8) == b"x"
        for untouched in (from_child_elsewhere, from_me, mine):
            untouched.setblocking(False)
            with pytest.raises(BlockingIOError):  # open, nothing to read
                untouched.recv(8)
        assert connections.close_from("localhost:x:y:z") == 0
        assert connections.close_from("") == 0
        assert EndpointConnections("inproc://events").close_from(f"localhost:{uid}:{gid}:1") == 0
    finally:
        child.kill()
        child.wait()
        for sock in (listener, other_listener):
            sock.close()


def test_peer_connections_on_tcp_closes_that_addresss_connections_on_the_port() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    try:
        port = listener.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        accepted = [listener.accept()[0] for _ in clients]
        elsewhere = socket.create_connection(("127.0.0.1", other.getsockname()[1]))
        accepted_elsewhere, _ = other.accept()
        connections = EndpointConnections(f"tcp://127.0.0.1:{port}")
        assert connections.close_from("10.9.8.7") == 0
        assert connections.close_from("127.0.0.1") == 2
        for client in clients:
            client.settimeout(HANG_S)
            assert client.recv(8) == b""
        elsewhere.setblocking(False)
        with pytest.raises(BlockingIOError):
            elsewhere.recv(8)
        for sock in (*clients, *accepted, elsewhere, accepted_elsewhere):
            sock.close()
    finally:
        listener.close()
        other.close()


class QueuedMessages:
    """What ``_take_subscriptions`` uses of an XPUB, holding what subscribers sent:
    each message a frame with its ``Peer-Address``; ``applied``: the
    ``ZMQ_SUBSCRIBE``/``UNSUBSCRIBE`` options set, in order."""

    def __init__(self, messages: list[tuple[bytes, str]]) -> None:
        self.messages = messages
        self.applied: list[tuple[int, bytes]] = []

    def get(self, option: int) -> int:
        assert option == zmq.EVENTS
        return zmq.POLLIN if self.messages else 0

    def recv(self, flags: int, copy: bool) -> Any:
        if not self.messages:
            raise zmq.Again
        data, address = self.messages.pop(0)
        return type("Frame", (), {"bytes": data, "get": lambda self, name: address})()

    def setsockopt(self, option: int, value: bytes) -> None:
        self.applied.append((option, value))


class ClosedPeers:
    def __init__(self) -> None:
        self.closed: list[str] = []

    def close_from(self, *addresses: str) -> int:
        self.closed.extend(addresses)
        return len(addresses)


def test_no_subscription_after_one_that_is_none_is_applied_until_the_queue_empties() -> None:
    """libzmq 4.3.5 queues no connection with an XSUB's message that is no
    subscription, so the subscriptions read after it, until the queue is empty,
    would be applied to other subscribers' connections (DESIGN.md 124): none is,
    and their senders are disconnected to subscribe again."""
    publisher = EventPublisher(
        zmq.Context.instance(), "inproc://unused", health=dict, health_interval_s=1.0
    )
    peers = ClosedPeers()
    publisher._peers = peers  # type: ignore[assignment]
    queued = QueuedMessages(
        [
            (b"\x01health", "a"),
            (b"junk", "x"),
            (b"\x01alert", "a"),
            (b"\x01thermal", "b"),
        ]
    )
    assert publisher._take_subscriptions(queued) is False  # type: ignore[arg-type]
    assert queued.applied == [(zmq.SUBSCRIBE, b"health")]  # only the one before the junk
    assert peers.closed == ["x", "a", "b"]
    assert publisher.subscriptions_refused == 1
    # The queue was empty: what comes next is applied again.
    queued.messages = [(b"\x01alert", "a")]
    publisher._take_subscriptions(queued)  # type: ignore[arg-type]
    assert queued.applied[-1] == (zmq.SUBSCRIBE, b"alert")
