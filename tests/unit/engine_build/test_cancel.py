"""One shared cancellation token: sources, first cause wins, latencies, the
no-cancel zone, signals and asyncio."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from inferd.engine_build import (
    CANCEL_SOURCES,
    CancellationToken,
    cancel_on_signals,
    run_build_async,
)
from tests.conftest import wait_until


def test_first_source_wins_and_is_recorded() -> None:
    token = CancellationToken()
    assert token.state() == "none" and not token.is_set()
    assert token.cancel("ide", "stop button") is True
    assert token.cancel("sigterm") is False
    assert token.is_set() and token.source == "ide"
    assert token.request is not None and token.request.reason == "stop button"
    assert [r.source for r in token.ignored] == ["sigterm"]


def test_unknown_source_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown cancel source"):
        CancellationToken().cancel("gremlins")
    assert set(CANCEL_SOURCES) >= {"sigint", "sigterm", "control", "ide", "timeout", "asyncio"}


def test_latencies_request_to_ack_to_cleanup() -> None:
    token = CancellationToken()
    token.acknowledge()  # nothing requested: nothing measured
    assert token.cancel_latency_ms is None
    token.cancel("control")
    time.sleep(0.02)  # time passing between the steps: the latencies measured below
    token.acknowledge()
    assert token.state() == "acknowledged"
    time.sleep(0.01)  # likewise
    token.cleanup_done()
    assert token.state() == "cleaned_up"
    assert token.cancel_latency_ms is not None and token.cancel_latency_ms >= 20
    assert token.cleanup_latency_ms is not None and token.cleanup_latency_ms >= 10


def test_listeners_hear_the_request_once() -> None:
    token = CancellationToken()
    heard: list[str] = []
    token.add_listener(lambda request: heard.append(request.source))
    token.cancel("control")
    token.cancel("ide")
    assert heard == ["control"]


def test_no_cancel_zone_records_a_deferred_cancel() -> None:
    token = CancellationToken()
    with token.no_cancel_zone("final engine write"):
        token.cancel("control")
        assert token.request is not None and token.request.in_no_cancel_zone
    assert token.zone_log[-1]["deferredCancel"] == "control"


def test_no_cancel_zone_is_not_entered_after_a_cancel() -> None:
    """The check and the entry are one step: a cancel either stops the commit or is
    recorded as deferred, never neither."""
    token = CancellationToken()
    with token.no_cancel_zone("first") as entered:
        assert entered
    assert token.zone_log[-1]["deferredCancel"] is None
    token.cancel("control")
    with token.no_cancel_zone("final engine commit") as entered:
        assert not entered and token.zone is None
    assert [entry["zone"] for entry in token.zone_log] == ["first"]


@pytest.mark.parametrize(
    ("signum", "source"), [(signal.SIGINT, "sigint"), (signal.SIGTERM, "sigterm")]
)
def test_signals_set_the_token(signum: int, source: str) -> None:
    token = CancellationToken()
    before = signal.getsignal(signum)
    with cancel_on_signals(token):
        os.kill(os.getpid(), signum)
        wait_until(token.is_set, message="the signal handler")
    assert token.source == source
    assert signal.getsignal(signum) is before


def test_second_sigint_forces() -> None:
    token = CancellationToken()
    forced: list[bool] = []
    with cancel_on_signals(token, force=lambda: forced.append(True)):
        os.kill(os.getpid(), signal.SIGINT)
        wait_until(token.is_set, message="the first SIGINT handled")
        os.kill(os.getpid(), signal.SIGINT)
        wait_until(lambda: forced, message="the second SIGINT handled")
    assert token.source == "sigint" and forced == [True]


def test_asyncio_cancellation_sets_the_token_and_waits_for_the_build() -> None:
    started = threading.Event()
    finished: list[str] = []

    def build(token: CancellationToken) -> str:
        started.set()
        while not token.is_set():
            time.sleep(0.005)  # the fake build's work between two cancellation checks
        finished.append(token.source or "")
        return "stopped"

    async def outer() -> CancellationToken:
        token = CancellationToken()
        task = asyncio.create_task(run_build_async(build, token))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return token

    token = asyncio.run(outer())
    assert token.source == "asyncio"
    assert finished == ["asyncio"]  # the build ended before CancelledError reached us


def test_run_build_async_returns_the_result() -> None:
    result = object()  # no value the call could make up
    tokens: list[CancellationToken] = []

    def build(token: CancellationToken) -> object:
        tokens.append(token)
        return result

    assert asyncio.run(run_build_async(build)) is result
    assert len(tokens) == 1 and not tokens[0].is_set()  # a fresh token of its own
