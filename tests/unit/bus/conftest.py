"""What the bus tests share: a real ``BusServer`` on ``ipc://`` sockets, and a
real ``EventPublisher`` on an ``ipc://`` events endpoint."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from inferd.bus.handler import RequestHandler
from inferd.bus.publisher import EventPublisher
from inferd.bus.server import BusServer
from inferd.config import BusConfig
from tests.conftest import HANG_S


def bus_config(directory: Path, **limits: Any) -> BusConfig:
    """The three sockets on ``ipc://`` paths in ``directory``; ``limits`` as given."""
    return BusConfig(
        infer_endpoint=f"ipc://{directory}/infer.sock",
        control_endpoint=f"ipc://{directory}/control.sock",
        events_endpoint=f"ipc://{directory}/events.sock",
        **limits,
    )


@contextmanager
def serving_bus(config: BusConfig, handler: RequestHandler) -> Iterator[BusServer]:
    """A bus thread bound and serving ``handler``; stopped, joined and its context
    ended after."""
    context: zmq.Context[Any] = zmq.Context()
    bus = BusServer(context, config, handler=handler, linger_ms=0)
    bus.start()
    bus.wait_bound(HANG_S)
    try:
        yield bus
    finally:
        bus.stop()
        bus.join(HANG_S)
        context.term()


@pytest.fixture
def endpoint(short_tmp_path: Path) -> str:
    """The events endpoint of ``publisher``."""
    return f"ipc://{short_tmp_path}/events.sock"


@pytest.fixture
def publisher(endpoint: str) -> Iterator[EventPublisher]:
    context: zmq.Context[Any] = zmq.Context()
    publisher = EventPublisher(
        context, endpoint, health=lambda: {"state": "serving"}, health_interval_s=0.05
    )
    publisher.start()
    publisher.wait_bound(HANG_S)
    yield publisher
    publisher.stop()
    publisher.join(HANG_S)
    context.destroy(linger=0)
