"""The bus thread's stop while a client keeps sending (``bus.stop_flag``), on a real
``BusServer`` and real ZeroMQ sockets.

The stopped bus read on until a pass found nothing to read: a DEALER pipelining
requests held it until the stop's ``bus.join`` bound (10 s) ran out, and the stop
went on without it (``threads_did_not_stop``, its sockets open, the context not
terminated).  It now reads for ``READS_AFTER_STOP_NS`` after the stop, then sends
what is owed and ends; a request waiting at the stop is still answered, and so
is a reply owed before it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inferd.bus.codec import Request
from inferd.bus.handler import Reply
from inferd.bus.server import BusServer
from inferd.bus.stop_flag import READS_AFTER_STOP_NS
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError
from tests.conftest import HANG_S, wait_until
from tests.integration.wire import RawDealer
from tests.unit.bus.conftest import bus_config, serving_bus

#: A client that never stops sending (and reads what comes back, so that its
#: replies never meet the high-water mark): a process of its own, so that the GIL
#: it would share with the bus thread cannot pace it.
FLOOD = """
import sys, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
request = bytes.fromhex(sys.argv[2])
while True:
    try:
        sock.send(request, zmq.NOBLOCK)
    except zmq.Again:
        sock.poll(10, zmq.POLLOUT)
    while sock.poll(0):
        sock.recv_multipart()
"""

#: The one request the handler admits: the test owes its reply, as the stop's drain
#: owes the replies of the requests it fails.
ADMITTED_ID = 7


class RefusingHandler:
    """``bus.handler.RequestHandler``: refuses every request but ``ADMITTED_ID``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.refused = 0
        self.admitted: list[Request] = []
        self.owed: list[Reply] = []

    def handle_infer(self, request: Request) -> Reply | None:
        if request.request_id == ADMITTED_ID:
            self.admitted.append(request)
            return None
        with self._lock:
            self.refused += 1
        raise ProtocolError(Code.UNAVAILABLE, "the daemon is shutting down")

    def prepared_for(self, route: bytes, repeat: bytes) -> None:
        return None

    def admit_prepared(self, prepared: Any, request: Request) -> None:
        raise AssertionError("nothing is prepared")

    def handle_control(self, request: Request) -> Reply | None:
        raise AssertionError("no control traffic in these tests")

    def due_replies(self, now_ns: int) -> list[Reply]:
        with self._lock:
            due, self.owed = self.owed, []
        return due

    def next_wakeup_ns(self) -> int | None:
        return time.monotonic_ns() if self.owed else None


@pytest.fixture
def bus(short_tmp_path: Path) -> Iterator[tuple[BusServer, RefusingHandler]]:
    handler = RefusingHandler()
    with serving_bus(bus_config(short_tmp_path), handler) as server:
        yield server, handler


def test_a_client_that_never_stops_sending_does_not_hold_the_stopped_bus(
    bus: tuple[BusServer, RefusingHandler],
) -> None:
    server, handler = bus
    endpoint = server._endpoints["infer"]
    header = {"v": 1, "id": 1, "op": "infer", "model": "m", "inputs": []}
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, endpoint, protocol.pack(header).hex()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with RawDealer(endpoint) as owed_to, RawDealer(endpoint) as waiting:
            owed_to.send([protocol.pack({**header, "id": ADMITTED_ID})])
            wait_until(lambda: handler.admitted, HANG_S, message="the request admitted")
            wait_until(lambda: handler.refused > 1000, HANG_S, message="the flood read")
            admitted = handler.admitted[0]
            with handler._lock:  # owed before the stop, as the drain's failures are
                error = protocol.error_header(ADMITTED_ID, Code.UNAVAILABLE, "not run")
                handler.owed.append(Reply(admitted.envelope, error))
            waiting.send([protocol.pack({**header, "id": 8})])  # waits at the stop
            stopped = time.monotonic()
            server.stop()
            server.join(2.0)  # 20 times what it may read for after the stop
            took_s = time.monotonic() - stopped
            assert not server.is_alive(), "the flood held the stopped bus thread"
            assert flood.poll() is None, "the flood ended by itself"
            owed, _ = owed_to.recv(HANG_S)
            refused, _ = waiting.recv(HANG_S)
    finally:
        flood.kill()
        flood.wait(HANG_S)
    assert owed["id"] == ADMITTED_ID and owed["error"]["code"] == "UNAVAILABLE"
    assert refused["id"] == 8 and refused["error"]["code"] == "UNAVAILABLE"
    assert took_s < 1.0 + READS_AFTER_STOP_NS / 1e9, took_s
