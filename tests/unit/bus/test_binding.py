"""A socket thread's bind failure reaches the thread that waits for it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import zmq

from inferd.bus.binding import BindOutcome
from inferd.bus.publisher import EventPublisher


def test_the_bind_error_itself_is_raised_in_the_waiting_thread() -> None:
    outcome = BindOutcome("the test thread")
    error = zmq.ZMQError(zmq.EADDRINUSE)
    threading.Thread(target=outcome.failed, args=(error,)).start()
    with pytest.raises(zmq.ZMQError) as raised:
        outcome.wait(timeout=10)
    assert raised.value is error


def test_a_thread_that_never_binds_is_a_timeout_naming_it() -> None:
    with pytest.raises(TimeoutError, match="the test thread did not bind in time"):
        BindOutcome("the test thread").wait(timeout=0.01)


def test_the_publisher_reports_an_endpoint_it_cannot_bind(tmp_path: Any) -> None:
    context: zmq.Context[Any] = zmq.Context()
    try:
        publisher = EventPublisher(
            context,
            "ipc://" + str(tmp_path / "missing" / "events.sock"),
            health=dict,
            health_interval_s=1.0,
        )
        publisher.start()
        with pytest.raises(zmq.ZMQError):
            publisher.wait_bound(timeout=10)
        publisher.join(timeout=10)
        assert not publisher.is_alive()
    finally:
        context.term()
