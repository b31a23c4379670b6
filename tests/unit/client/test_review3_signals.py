"""A signal does not stretch a call's timeout (third review of the Python client).

pyzmq retries a blocking ``recv``/``send`` that a signal interrupted (``EINTR``)
with the full ``RCVTIMEO``/``SNDTIMEO`` again, and its ``zmq_poll`` subtracts the
time passed in whole seconds: under a periodic signal of the calling program (a
timer, here 100 Hz ``setitimer``) a request waited for good, and an event wait
until the next whole second.  Each test bounds the old hang with a handler that
raises ``Stretched`` once the call has outlived its timeout by far."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from inferd_client import EventSubscriber, InferenceClient, OperatorClient, RequestTimeout
from tests.unit.client.scripted import Script

#: The timer's period, s: much shorter than any timeout below.
PERIOD_S = 0.01
#: How long past its timeout a call may return (scheduling on a loaded CI host).
SLACK_S = 0.25
#: Past this, the handler ends a call that would otherwise wait for good.
BOUND_S = 3.0


class Stretched(Exception):
    """A call was still waiting ``BOUND_S`` after it started."""


@pytest.fixture
def timer() -> Iterator[Callable[[], list[int]]]:
    """``start()``: a 100 Hz ``SIGALRM`` whose handler counts (and raises
    ``Stretched`` past ``BOUND_S``); stopped and restored after the test."""
    previous = signal.getsignal(signal.SIGALRM)
    count = [0]

    def start() -> list[int]:
        started = time.monotonic()

        def handler(signum: int, frame: object) -> None:
            count[0] += 1
            if time.monotonic() - started > BOUND_S:
                signal.setitimer(signal.ITIMER_REAL, 0)
                raise Stretched(f"still waiting after {BOUND_S} s, {count[0]} signals")

        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, PERIOD_S, PERIOD_S)
        return count

    yield start
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def test_a_reply_wait_ends_at_its_timeout_under_a_periodic_signal(
    server: Callable[[Script], str], timer: Callable[[], list[int]]
) -> None:
    endpoint = server(lambda sock, frames: None)  # reads every request, answers none
    with InferenceClient(endpoint, timeout=0.3) as client, OperatorClient(endpoint) as operator:
        count = timer()
        for call in (
            lambda: client.infer("m", {"x": np.zeros(2, np.float32)}),
            lambda: operator.call("status", timeout=0.3),
        ):
            started = time.monotonic()
            with pytest.raises(RequestTimeout):
                call()
            elapsed = time.monotonic() - started
            assert 0.3 <= elapsed < 0.3 + SLACK_S, elapsed
        assert count[0] >= 30  # the signals did come during the waits


def test_a_send_that_cannot_leave_ends_at_its_timeout_under_a_periodic_signal(
    tmp_path: Path, timer: Callable[[], list[int]]
) -> None:
    # No daemon at the endpoint: with ZMQ_IMMEDIATE the request cannot be queued,
    # so the call waits in the send for a connection.
    with OperatorClient(f"ipc://{tmp_path}/absent.sock", timeout=0.3) as operator:
        count = timer()
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            operator.status()
        elapsed = time.monotonic() - started
        assert 0.3 <= elapsed < 0.3 + SLACK_S, elapsed
        assert count[0] >= 20


def test_an_event_wait_ends_at_its_timeout_under_a_periodic_signal(
    tmp_path: Path, timer: Callable[[], list[int]]
) -> None:
    context = zmq.Context.instance()
    publisher = context.socket(zmq.PUB)
    publisher.bind(f"ipc://{tmp_path}/events.sock")
    try:
        with EventSubscriber(f"ipc://{tmp_path}/events.sock") as subscriber:
            # pyzmq's zmq_poll took off the time passed in whole seconds of the
            # monotonic clock: the wait ended at the first whole second after its
            # deadline.  Started 0.6 s into a second, a 0.5 s wait's deadline is
            # 0.1 s into the next, so the old wait took 1.4 s (not a sync: a phase).
            time.sleep((0.6 - time.monotonic() % 1.0) % 1.0)
            count = timer()
            started = time.monotonic()
            assert subscriber.receive(0.5) is None
            elapsed = time.monotonic() - started
            assert 0.5 <= elapsed < 0.5 + SLACK_S, elapsed
            assert count[0] >= 30
    finally:
        publisher.close(linger=0)
