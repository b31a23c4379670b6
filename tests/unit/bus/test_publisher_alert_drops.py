"""The ``pub`` alert hook counts an alert the publisher dropped as a failure, not
as sent (review R1 of the alert links, session 12, F4; DESIGN.md 317 did the same
for the ``fdr`` hook with ``record_alert``).

Before: ``EventPublisher.publish`` counted a drop (its queue full, the publisher
stopped or its thread ended) and returned, so ``status.alerts.hooks.pub`` read
``sent N, failures 0`` for alerts that never reached the PUB socket.  Now the
daemon hands the hook ``publish_alert``, which raises ``EventDroppedError`` (a
``ConnectionError``) for a drop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from inferd import config as config_module
from inferd.alerts import AlertDispatcher, PubAlertHook
from inferd.bus.publisher import EventDroppedError, EventPublisher
from inferd.daemon import Daemon
from inferd.types import Alert
from tests.conftest import render_config


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    made: zmq.Context[Any] = zmq.Context()
    yield made
    made.destroy(linger=0)


def _counts(dispatcher: AlertDispatcher) -> tuple[int, int]:
    hook = dispatcher.status()["hooks"]["pub"]
    return hook["sent"], hook["failures"]


def test_an_alert_the_publisher_drops_is_a_failure_of_the_pub_hook(
    context: zmq.Context[Any],
) -> None:
    # Never started: the queue fills as when its thread falls behind by its capacity.
    publisher = EventPublisher(
        context, "inproc://alert-drops", health=dict, health_interval_s=1.0, capacity=1
    )
    dispatcher = AlertDispatcher([PubAlertHook(publisher.publish_alert)], rate_limit_s=0)
    with capture_logs() as logs:
        dispatcher(Alert("ERROR", "first", "queued"))
        dispatcher(Alert("ERROR", "second", "the queue is full"))
        assert _counts(dispatcher) == (1, 1)  # before: (2, 0)
        assert "queue full" in str(dispatcher.status()["hooks"]["pub"]["last_error"])
        publisher.stop()  # its thread never ran: what was queued is dropped, and counted
        dispatcher(Alert("CRITICAL", "third", "the publisher has stopped"))
        assert _counts(dispatcher) == (1, 2)
    assert publisher.dropped == 3  # the drops are still the publisher's to count
    assert [line["event"] for line in logs].count("events_dropped") == 1  # the first


def test_publish_alert_raises_a_connection_error_only_for_a_drop(
    context: zmq.Context[Any],
) -> None:
    publisher = EventPublisher(
        context, "inproc://alert-raises", health=dict, health_interval_s=1.0, capacity=1
    )
    payload = {"level": "ERROR", "code": "c", "message": "m", "fields": {}}
    publisher.publish_alert("alert", payload)  # queued: nothing raised
    with capture_logs(), pytest.raises(EventDroppedError, match="queue full") as dropped:
        publisher.publish_alert("alert", payload)
    assert isinstance(dropped.value, ConnectionError)
    publisher.publish("alert", payload)  # the plain one still never raises for a drop
    assert publisher.dropped == 2
    with pytest.raises(ValueError, match="unknown event topic"):
        publisher.publish_alert("no-such-topic", payload)


def test_the_daemon_hands_the_pub_hook_the_publisher_that_fails_a_drop(tmp_path: Path) -> None:
    (tmp_path / "inferd.toml").write_text(
        render_config(tmp_path, [{"name": "demo", "path": str(tmp_path / "never-loaded.onnx")}])
    )
    daemon = Daemon(config_module.load(tmp_path / "inferd.toml"))  # built, not started
    try:
        with capture_logs():
            daemon.publisher.stop()  # as once its thread ended
            daemon.alerts(Alert("CRITICAL", "engine_worker_died", "the worker died"))
        pub = daemon.alerts.status()["hooks"]["pub"]
        assert (pub["sent"], pub["failures"]) == (0, 1), pub  # before: (1, 0)
    finally:
        with capture_logs():
            daemon.alerts.close()
        daemon._context.destroy(linger=0)
