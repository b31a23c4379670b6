"""A real daemon's events socket bounds what subscribers make it hold (DESIGN.md 124).

A review sent one 16 MiB subscription to the events socket (then a PUB): the
daemon went from 88 to 857 MiB, and 1.8 GiB once the subscriber left.  Now a
message over 512 bytes ends its connection as its header arrives, a subscription
that no topic can match is refused, counted in ``status`` and ends its process's
connections, and subscribers by topic, by prefix and to everything are served as
before.  A refused subscriber runs in a child process: the daemon closes every
events connection of the refused process, and the test's subscribers are in this one.
"""

from __future__ import annotations

from typing import Any

import zmq

from inferd_client import EventSubscriber, OperatorClient
from tests.conftest import HANG_S, DaemonFactory, DaemonProcess, Events, memory_kib, wait_until
from tests.events_peers import (
    ChildSubscriber,
    closed_by_peer,
    long_frame_header,
    send_until_closed,
    zmtp_connect,
)

#: What the review's message made the daemon hold was 770 MiB; a bounded read of
#: it holds nothing.  A margin for the allocator's own growth meanwhile.
RSS_MARGIN_BYTES = 64 << 20


def _bus(daemon: DaemonProcess) -> dict[str, Any]:
    with OperatorClient(daemon.control, timeout=HANG_S) as operator:
        bus: dict[str, Any] = operator.status()["bus"]
    return bus


def test_an_oversized_subscription_ends_its_connection_and_publishing_goes_on(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    with Events(daemon.events) as events:
        before = memory_kib(daemon) * 1024
        size = 16 << 20
        for _attempt in range(2):  # and again, as the review's subscriber reconnected
            raw = zmtp_connect(daemon.events)
            sent = send_until_closed(raw, long_frame_header(size) + b"\x01" + b"a" * (size - 1))
            assert closed_by_peer(raw), "the daemon kept reading a 16 MiB subscription"
            raw.close()
            assert sent < size
        events.settle()  # two health events stamped after now: it still publishes
        assert memory_kib(daemon) * 1024 - before < RSS_MARGIN_BYTES
    bus = _bus(daemon)
    # libzmq ends the connection at the frame's header: the daemon never read it
    assert bus["events_subscriptions_refused"] == 0
    assert daemon.process.poll() is None


def test_a_subscription_no_topic_matches_is_refused_counted_and_gets_nothing(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    with (
        Events(daemon.events, topics=("build",)) as events,
        ChildSubscriber(daemon.events, b"\x01bogus") as child,
    ):
        assert child.disconnected(), "the daemon kept a subscription to 'bogus'"
        bus = wait_until(
            lambda: (bus := _bus(daemon))["events_subscriptions_refused"] >= 1 and bus,
            message="the refusal in status",
        )
        assert bus["events_published"] > 0
        events.settle()  # this process's subscriber still gets the events
        assert child.received() == 0
    log = daemon.log()
    assert "events_subscription_refused" in log and "bogus" in log


def test_subscribers_by_topic_by_prefix_and_to_everything_get_their_events(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    context: zmq.Context[Any] = zmq.Context()
    prefix = context.socket(zmq.SUB)
    try:
        prefix.subscribe(b"heal")
        prefix.connect(daemon.events)
        with (
            Events(daemon.events) as everything,
            Events(daemon.events, topics=("health",)) as health,
            EventSubscriber(daemon.events, topics=["build"], context=context) as build,
        ):
            build.wait_joined(HANG_S)  # subscribed to health to join, then unsubscribed
            assert prefix.poll(int(HANG_S * 1000)), "a subscriber to b'heal' got nothing"
            assert prefix.recv_multipart()[0] == b"health"
            assert {topic for topic, _ in everything.settle()} >= {"health"}
            assert {topic for topic, _ in health.settle()} == {"health"}
        assert _bus(daemon)["events_subscriptions_refused"] == 0
    finally:
        prefix.close(linger=0)
        context.destroy(linger=0)
