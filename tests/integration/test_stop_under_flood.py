"""A real daemon stopped while a client keeps sending requests (``bus.stop_flag``).

Its bus thread read on until a pass found nothing to read, so one DEALER that
pipelines requests held it: SIGTERM took the stop's whole ``bus.join`` bound
(10 s, measured 10.1 s against 0.16 s without the client), then the stop went
on without the thread (``threads_did_not_stop``: the context not terminated).
Now the bus reads for a moment after its stop (a request waiting is answered
``UNAVAILABLE``), then sends what is owed and ends."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from inferd_wire import protocol
from tests.conftest import HANG_S, DaemonFactory, wait_until

pytestmark = pytest.mark.integration


def _flood(endpoint: str, stop: threading.Event, codes: list[str]) -> None:
    """Send a request the daemon refuses, again and again without waiting, reading
    the replies as they come (so none meets the high-water mark)."""
    context: zmq.Context[Any] = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    request = protocol.pack({"v": 1, "id": 1, "op": "infer", "model": "demo", "inputs": []})
    try:
        while not stop.is_set():
            try:
                sock.send(request, zmq.NOBLOCK)
            except zmq.Again:
                sock.poll(10, zmq.POLLOUT)
            while sock.poll(0):
                reply = protocol.unpack_header(sock.recv_multipart()[0])
                codes.append(reply["error"]["code"])
    finally:
        sock.close(linger=0)


def test_a_client_that_keeps_sending_does_not_hold_the_daemons_stop(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory()
    stop, codes = threading.Event(), list[str]()
    flood = threading.Thread(target=_flood, args=(daemon.infer, stop, codes), daemon=True)
    flood.start()
    try:
        wait_until(lambda: len(codes) > 1000, HANG_S, message="the flood answered")
        stopped = time.monotonic()
        returncode = daemon.stop(timeout=HANG_S + 10)
        took_s = time.monotonic() - stopped
    finally:
        stop.set()
        flood.join(HANG_S)
    assert returncode == 0, daemon.log()
    assert "threads_did_not_stop" not in daemon.log()
    assert took_s < 3.0, took_s  # 10.1 s before: the bus thread's whole join bound
    assert "INVALID_ARGUMENT" in codes and "UNAVAILABLE" in codes  # refused once stopping
