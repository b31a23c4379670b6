"""An error after a socket thread has bound is the thread's own, not its start's
(DESIGN.md 166, ``BindOutcome.failed`` returns False once bound): the start that
succeeded stays a success and the error reaches the thread's hook, as before the
setup after the bind moved into the ``try`` that reports to the start."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest
import zmq

from inferd.bus.binding import BindOutcome
from inferd.bus.handler import RequestHandler
from inferd.bus.server import BusServer
from inferd.config import BusConfig
from tests.conftest import HANG_S


def test_a_failure_after_the_bind_does_not_fail_the_start_that_succeeded() -> None:
    outcome = BindOutcome("the test thread")
    outcome.bound()
    assert outcome.failed(RuntimeError("the loop died later")) is False
    outcome.wait(timeout=0)  # still bound: raises nothing


def test_a_bus_loop_that_dies_after_its_start_raises_in_its_own_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = BusConfig(
        infer_endpoint=f"ipc://{tmp_path}/infer.sock",
        control_endpoint=f"ipc://{tmp_path}/control.sock",
        events_endpoint=f"ipc://{tmp_path}/events.sock",
    )
    raised: list[BaseException | None] = []
    seen = threading.Event()

    def hook(args: threading.ExceptHookArgs) -> None:
        raised.append(args.exc_value)
        seen.set()

    monkeypatch.setattr(threading, "excepthook", hook)
    error = RuntimeError("the loop died after the start")
    proceed = threading.Event()

    def loop(infer: object, control: object) -> None:
        proceed.wait(HANG_S)  # the start has been told it bound
        raise error

    context: zmq.Context[Any] = zmq.Context()
    bus = BusServer(context, config, handler=cast(RequestHandler, None), linger_ms=0)
    bus._loop = loop  # type: ignore[method-assign]
    bus.start()
    try:
        bus.wait_bound(timeout=HANG_S)
        proceed.set()
        assert seen.wait(HANG_S), "the loop's error was swallowed, not raised in its thread"
        assert raised == [error]
        bus.join(HANG_S)
        assert not bus.is_alive()
    finally:
        proceed.set()
        bus.join(HANG_S)
        context.term()
