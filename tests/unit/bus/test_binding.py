"""A socket thread's bind failure reaches the thread that waits for it; a send
buffer the kernel caps is logged once."""

from __future__ import annotations

import errno
import select
import threading
from typing import Any, cast

import pytest
import structlog
import zmq

from inferd.bus.binding import BindOutcome, size_new_connections
from inferd.bus.handler import RequestHandler
from inferd.bus.publisher import EventPublisher
from inferd.bus.server import BusServer
from inferd.config import BusConfig
from inferd_wire.endpoints import MAX_SEND_BUFFER_BYTES
from inferd_wire.send_buffer import SendBuffer
from tests.conftest import HANG_S, net_core


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


def test_a_send_buffer_the_kernel_caps_is_logged_once(tmp_path: Any) -> None:
    """``size_new_connections``: every connection sized, the first cap logged with
    what was asked and got, later ones counted only (DESIGN.md 116)."""
    wmem_max = net_core("wmem_max")
    asked = MAX_SEND_BUFFER_BYTES
    context: zmq.Context[Any] = zmq.Context()
    endpoint = "ipc://" + str(tmp_path / "infer.sock")
    send_buffer = SendBuffer(endpoint, asked)
    try:
        router = context.socket(zmq.ROUTER)
        send_buffer.watch(router)
        router.bind(endpoint)
        dealers = []
        with structlog.testing.capture_logs() as logs:
            for count in (1, 2):
                dealer = context.socket(zmq.DEALER)
                dealer.connect(endpoint)
                dealers.append(dealer)
                assert send_buffer.monitor is not None
                while send_buffer.sized < count:
                    assert send_buffer.monitor.poll(10_000), "no connection event"
                    size_new_connections(send_buffer)
        capped = [entry for entry in logs if entry["event"] == "send_buffer_capped"]
        if wmem_max >= asked:  # a kernel that admits 64 MiB caps nothing
            assert capped == [] and send_buffer.capped == 0
        else:
            assert send_buffer.capped == 2
            assert len(capped) == 1
            assert capped[0]["asked_bytes"] == asked
            assert capped[0]["effective_bytes"] == wmem_max
    finally:
        send_buffer.close()
        context.destroy(linger=0)


class _RefusingEpoll:
    """An epoll set whose ``register`` fails as the kernel's may (``ENOMEM``)."""

    def register(self, fd: int, eventmask: int = 0) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")


def test_a_bus_that_bound_but_cannot_wait_on_its_sockets_fails_its_start(tmp_path: Any) -> None:
    """What follows the bind (the request sources' epoll set) failing is the start's
    failure, raised to the waiting thread, with both sockets closed: the context
    terminates (it hung with a socket open), and the endpoints bind again."""
    config = BusConfig(
        infer_endpoint=f"ipc://{tmp_path}/infer.sock",
        control_endpoint=f"ipc://{tmp_path}/control.sock",
        events_endpoint=f"ipc://{tmp_path}/events.sock",
    )
    context: zmq.Context[Any] = zmq.Context()
    bus = BusServer(context, config, handler=cast(RequestHandler, None), linger_ms=0)
    bus._requests = cast(select.epoll, _RefusingEpoll())
    bus.start()
    with pytest.raises(OSError) as raised:
        bus.wait_bound(timeout=HANG_S)
    assert raised.value.errno == errno.ENOMEM
    bus.join(HANG_S)
    assert not bus.is_alive()
    terminating = threading.Thread(target=context.term, daemon=True)
    terminating.start()
    terminating.join(HANG_S)
    assert not terminating.is_alive(), "a socket of the failed bus was left open"
    with zmq.Context() as again, again.socket(zmq.ROUTER) as router:
        router.bind(config.infer_endpoint)
        router.close(linger=0)
