"""The publisher sends no event over ``MAX_EVENT_BYTES`` (``bus/publisher.py``
``_send``): each would end every client's connection (their bound), and
``SUBSCRIBER_SNDHWM`` of them queued for one slow subscriber would hold gigabytes
(review R2 of session 15: build events of 4 MiB)."""

from __future__ import annotations

from structlog.testing import capture_logs

from inferd.bus.publisher import EventPublisher
from inferd_client import EventSubscriber
from inferd_wire.topics import MAX_EVENT_BYTES
from tests.conftest import HANG_S


def test_the_publisher_sends_no_event_over_the_clients_bound(
    publisher: EventPublisher, endpoint: str
) -> None:
    with EventSubscriber(endpoint, topics=["build"]) as subscriber:
        subscriber.wait_joined(HANG_S)
        with capture_logs() as logs:
            publisher.publish("build", {"pad": "x" * MAX_EVENT_BYTES})
            publisher.publish("build", {"after": True})
            event = subscriber.receive(HANG_S)
        assert event == (
            "build",
            {"after": True, "seq": event[1]["seq"], "ts_ns": event[1]["ts_ns"]},
        )
        assert subscriber.connections_lost == 0  # before: the big one ended the connection
    assert publisher.dropped == 1
    dropped = [line for line in logs if line["event"] == "events_dropped"]
    assert dropped and "over MAX_EVENT_BYTES" in dropped[0]["reason"]
