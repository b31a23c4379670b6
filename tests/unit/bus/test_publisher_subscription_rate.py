"""A peer's (un)subscriptions on the events socket are held to a rate (DESIGN.md 124).

libzmq moves what every connection sent into one queue of the XPUB whenever the
publisher thread touches it, faster than the thread takes it, and never drops
any: a connection sending valid (un)subscriptions back to back, none of them
refused, grew a process by hundreds of MiB in seconds.  Now a peer may send
``SUBSCRIBER_BURST`` at once, then one every ``SUBSCRIBER_REFILL_S``; past that
its messages are refused like a subscription no topic can match (counted, its
connections ended).  Real ZeroMQ sockets on ``ipc://`` (without a ZAP handler a
peer is its ``Peer-Address``: this process), and the pass itself on queued
messages with a clock the test moves.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from inferd.bus.publisher import SUBSCRIBER_BURST, SUBSCRIBER_REFILL_S, EventPublisher
from inferd.peer_rate_limit import PeerRateLimiter
from tests.conftest import wait_until
from tests.events_peers import closed_by_peer, zmtp_connect
from tests.unit.bus.test_publisher_subscriptions import (
    ClosedPeers,
    QueuedMessages,
    _topics_until,
)


def _frame(message: bytes) -> bytes:
    """``message`` as one ZMTP frame (short form)."""
    return b"\x00" + bytes([len(message)]) + message


def test_valid_subscriptions_past_the_burst_end_the_connection(
    publisher: EventPublisher, endpoint: str
) -> None:
    raw = zmtp_connect(endpoint)
    # Each valid, none refused by what it says: health, then its unsubscription.
    toggles = (_frame(b"\x01health") + _frame(b"\x00health")) * (SUBSCRIBER_BURST // 2 + 32)
    raw.sendall(toggles)
    assert closed_by_peer(raw), "a peer sending subscriptions without end was never closed"
    raw.close()
    wait_until(lambda: publisher.subscriptions_refused >= 1, message="the refusal counted")
    assert publisher.is_alive()


def test_subscribers_connecting_together_within_the_burst_are_served(
    publisher: EventPublisher, endpoint: str
) -> None:
    context: zmq.Context[Any] = zmq.Context.instance()
    subscribers: list[zmq.Socket[Any]] = []
    # 36 subscribers of one process, each to every topic and health: 252 messages.
    topics = (b"alert", b"build", b"runtime", b"thermal", b"", b"health", b"he")
    assert len(topics) * 36 <= SUBSCRIBER_BURST
    for _ in range(36):
        sock = context.socket(zmq.XSUB)
        sock.connect(endpoint)
        for topic in topics:
            sock.send(b"\x01" + topic)
        subscribers.append(sock)
    since_ns = time.time_ns()
    for sock in subscribers:  # each gets a health event stamped after they all subscribed
        _topics_until(sock, "health", since_ns)
    assert publisher.subscriptions_refused == 0
    for sock in subscribers:
        sock.close(linger=0)


def test_the_rate_is_per_peer_and_refills() -> None:
    now = [0.0]
    publisher = EventPublisher(
        zmq.Context.instance(), "inproc://unused", health=dict, health_interval_s=1.0
    )
    publisher._rate = PeerRateLimiter(  # the same limits, on the test's clock
        "events subscription", SUBSCRIBER_BURST, SUBSCRIBER_REFILL_S, "", clock=lambda: now[0]
    )
    peers = ClosedPeers()
    publisher._peers = peers  # type: ignore[assignment]
    flood = [(b"\x01health", "a")] * SUBSCRIBER_BURST + [(b"\x00health", "a"), (b"\x01he", "b")]
    queued = QueuedMessages(flood)
    assert publisher._take_subscriptions(queued) is False  # type: ignore[arg-type]
    # The burst applied; the next one of "a" refused and "a" closed; "b" is served.
    assert len(queued.applied) == SUBSCRIBER_BURST + 1
    assert queued.applied[-1] == (zmq.SUBSCRIBE, b"he")
    assert (publisher.subscriptions_refused, peers.closed) == (1, ["a"])
    # A second later "a" may send 1 / SUBSCRIBER_REFILL_S more (16), not one more.
    now[0] += 1.0
    again = int(1.0 / SUBSCRIBER_REFILL_S)
    queued.messages = [(b"\x00health", "a")] * (again + 1)
    queued.applied.clear()
    publisher._take_subscriptions(queued)  # type: ignore[arg-type]
    assert len(queued.applied) == again
    assert publisher.subscriptions_refused == 2
