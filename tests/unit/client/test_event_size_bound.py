"""An event frame over the subscriber's bound is refused by libzmq as its length
arrives, not taken whole into memory first; the subscriber then connects again
itself (libzmq does not after such a protocol error) and counts the connection
lost, so the events after it still arrive (DESIGN.md 236's leftover)."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import zmq

from inferd_client import EventSubscriber
from inferd_client.errors import MalformedReply
from inferd_client.events import MAX_EVENT_BYTES
from inferd_wire import protocol
from inferd_wire.curve import ClientCurve
from tests.conftest import HANG_S

_OVERSIZED_BYTES = 64 << 20


def _next_tick(
    publisher: zmq.Socket[Any], subscriber: EventSubscriber, refused: list[str]
) -> dict[str, Any]:
    """Publish numbered ``thermal`` events until one arrives (the subscriber has
    joined, or joined again); MalformedReply on the way is noted in ``refused``."""
    give_up_at = time.monotonic() + HANG_S
    for number in range(1_000_000):
        assert time.monotonic() < give_up_at, f"no event within {HANG_S} s ({refused=})"
        publisher.send_multipart([b"thermal", protocol.pack({"n": number})])
        try:
            event = subscriber.receive(timeout=0.05)
        except MalformedReply as exc:
            refused.append(str(exc))
            continue
        if event is not None:
            return event[1]
    raise AssertionError("unreachable")


def test_an_oversized_event_is_not_taken_into_memory_and_later_events_arrive(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    endpoint = f"ipc://{tmp_path}/events.sock"
    publisher = context.socket(zmq.PUB)
    publisher.bind(endpoint)
    oversized = b"\x00" * _OVERSIZED_BYTES  # made before the measurement starts
    refused: list[str] = []
    with EventSubscriber(endpoint, context=context) as subscriber:
        _next_tick(publisher, subscriber, refused)
        tracemalloc.start()
        try:
            publisher.send_multipart([b"thermal", oversized])
            after = _next_tick(publisher, subscriber, refused)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        lost = subscriber.connections_lost
    # Before ZMQ_MAXMSGSIZE: the 64 MiB frame was copied into a bytes object
    # (a peak of 64 MiB) and only then refused as a MalformedReply.
    assert peak < 4 << 20, f"the subscriber took {peak / 2**20:.1f} MiB for a refused event"
    assert refused == []
    assert lost == 1
    assert after["n"] >= 0


def test_a_stopped_publisher_is_one_lost_connection_and_no_event_twice(
    tmp_path: Path, context: zmq.Context[Any]
) -> None:
    """A daemon restart: libzmq connects again itself; the subscriber's own check
    must not add a second connection (each event would then arrive twice)."""
    endpoint = f"ipc://{tmp_path}/events.sock"
    publisher = context.socket(zmq.PUB)
    publisher.bind(endpoint)
    refused: list[str] = []
    with EventSubscriber(endpoint, context=context) as subscriber:
        _next_tick(publisher, subscriber, refused)
        publisher.close(linger=0)
        publisher = context.socket(zmq.PUB)
        publisher.bind(endpoint)
        first = _next_tick(publisher, subscriber, refused)["n"]
        following = list(range(first + 1_000_000, first + 1_000_005))
        for number in following:
            publisher.send_multipart([b"thermal", protocol.pack({"n": number})])
        received = [subscriber.receive(timeout=HANG_S) for _ in following]
        assert [event[1]["n"] if event else None for event in received] == following
        assert subscriber.receive(timeout=0.2) is None  # no copy of the last one
        assert subscriber.connections_lost == 1
    assert refused == []


def test_an_event_of_the_largest_size_still_arrives_over_curve(
    context: zmq.Context[Any],
) -> None:
    """The bound leaves room for CURVE's MESSAGE command around the frame."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    publisher = context.socket(zmq.PUB)
    publisher.curve_server = True
    publisher.curve_secretkey = server_secret
    publisher.bind("tcp://127.0.0.1:*")
    endpoint = publisher.getsockopt_string(zmq.LAST_ENDPOINT)
    curve = ClientCurve(server_public.decode(), client_public.decode(), client_secret.decode())
    refused: list[str] = []
    with EventSubscriber(endpoint, context=context, curve=curve) as subscriber:
        _next_tick(publisher, subscriber, refused)
        # ``pad`` as a msgpack bin16 (256 bytes or more) whatever its length
        pad = MAX_EVENT_BYTES - len(protocol.pack({"n": -1, "pad": b"\x00" * 256})) + 256
        largest = protocol.pack({"n": -1, "pad": b"\x00" * pad})
        assert len(largest) == MAX_EVENT_BYTES
        publisher.send_multipart([b"thermal", largest])
        event = subscriber.receive(timeout=HANG_S)
        assert event is not None and event[1]["n"] == -1
        assert subscriber.connections_lost == 0
    assert refused == []
