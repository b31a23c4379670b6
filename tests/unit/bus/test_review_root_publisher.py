"""The publisher thread's queue at its edges: an event it cannot send, events
published once it stopped, and a stop while its queue is full and no thread reads
it.  Every event is sent or counted in ``dropped``; nothing blocks the caller."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus.publisher import EventPublisher
from inferd_wire.protocol import unpack_header
from tests.conftest import HANG_S

WAIT_MS = int(HANG_S * 1000)


def _publisher(context: zmq.Context[Any], directory: Path, **options: Any) -> EventPublisher:
    return EventPublisher(
        context,
        f"ipc://{directory}/events.sock",
        health=lambda: {"state": "serving"},
        health_interval_s=0.05,
        **options,
    )


def _joined(context: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    """A SUB to every topic that has received a health event (it has joined)."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    assert sub.poll(WAIT_MS), "no health event"
    sub.recv_multipart()
    return sub


def _alerts(sub: zmq.Socket[Any], until: str) -> list[str]:
    """The codes of the alert events received until the one whose code is ``until``."""
    codes: list[str] = []
    while not codes or codes[-1] != until:
        assert sub.poll(WAIT_MS), f"no alert {until!r}"
        topic, payload = sub.recv_multipart()
        if topic == b"alert":
            codes.append(unpack_header(payload, check_version=False)["code"])
    return codes


def test_an_event_that_cannot_be_sent_is_dropped_and_the_thread_goes_on(
    context: zmq.Context[Any], short_tmp_path: Path
) -> None:
    """A payload msgpack cannot encode is counted as dropped; the events after it
    are still published (before: the publisher thread died on it, so no event or
    health beat was published again and the watchdog ended the daemon)."""
    publisher = _publisher(context, short_tmp_path)
    publisher.start()
    publisher.wait_bound(HANG_S)
    sub = _joined(context, f"ipc://{short_tmp_path}/events.sock")
    publisher.publish("alert", {"code": "bad", "fields": {"what": object()}})
    publisher.publish("alert", {"code": "good"})
    assert _alerts(sub, "good") == ["good"]
    assert publisher.dropped == 1
    assert publisher.is_alive()
    publisher.stop()
    publisher.join(HANG_S)
    sub.close()


def test_an_event_published_after_stop_is_counted_as_dropped(
    context: zmq.Context[Any], short_tmp_path: Path
) -> None:
    """What a late thread publishes once the publisher stopped (a switch still
    preparing at shutdown, a build's reader) is counted in ``dropped`` (before: it
    waited in the queue behind the stop, silently never sent)."""
    publisher = _publisher(context, short_tmp_path)
    publisher.start()
    publisher.wait_bound(HANG_S)
    publisher.stop()
    publisher.join(HANG_S)
    assert not publisher.is_alive()
    publisher.publish("runtime", {"model": "demo"})
    assert publisher.dropped == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # injected
def test_stop_returns_when_the_queue_is_full_and_no_thread_reads_it(
    context: zmq.Context[Any], short_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread ended on an error and the queue filled up behind it: ``stop``
    returns at once and the events left are counted as dropped (before: ``stop``
    waited forever to queue its marker, and with it the daemon's shutdown)."""
    publisher = _publisher(context, short_tmp_path, capacity=4)

    def broken(_sock: zmq.Socket[Any]) -> bool:
        raise zmq.ZMQError(zmq.EFAULT, "injected by the test")

    monkeypatch.setattr(publisher, "_take_subscriptions", broken)
    publisher.start()
    publisher.wait_bound(HANG_S)
    publisher.join(HANG_S)  # it ended on the error
    for index in range(6):
        publisher.publish("alert", {"code": f"a{index}"})
    stopper = threading.Thread(target=publisher.stop, daemon=True)
    stopper.start()
    stopper.join(HANG_S)
    assert not stopper.is_alive(), "stop() blocked on the full queue"
    assert publisher.dropped == 6
