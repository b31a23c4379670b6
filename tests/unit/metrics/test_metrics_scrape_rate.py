"""A local client scraping the metrics endpoint in a loop (any local user may:
docs/SECURITY.md) may not take the daemon's CPU and GIL from inference.

Every ``GET /metrics`` read ``Daemon.status()`` and encoded it, 2-8 ms holding the
GIL, and the thread took the next connection as soon as the last one ended: two
local processes scraping in a loop (about 150 scrapes a second) made inference's
p99 5-7 times worse.  Now a scrape within ``SCRAPE_CACHE_S`` of a collection is
served from it (each format encoded once), and after every connection the
listener rests ``MIN_REQUEST_GAP_S`` (the next ones wait in the listen backlog).

The exporter's clock is the test's, which moves only when the test moves it: the
bounds are counted (collections, connections served), never timed."""

from __future__ import annotations

import math
import select
import socket
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from inferd.config import MetricsConfig
from inferd.metrics import MetricsExporter
from inferd.metrics import http as metrics_http
from inferd.metrics.exporter import SCRAPE_CACHE_S
from tests.conftest import HANG_S
from tests.unit.metrics.test_families import status as status_document

SCRAPE = b"GET /metrics HTTP/1.0\r\n\r\n"
OPENMETRICS = (
    b"GET /metrics HTTP/1.0\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n"
)


class _Counting:
    """A daemon whose ``status`` counts the collections that read it."""

    slots: Mapping[str, Any] = {}

    def __init__(self) -> None:
        self.calls = 0

    def status(self, _header: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        return status_document()


class _Clock:
    """A monotonic clock that moves only when ``advance`` moves it, and counts
    how often it was read (by the exporter's thread: nothing else reads it)."""

    def __init__(self) -> None:
        self._now = 1000.0
        self._reads = 0
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            self._reads += 1
            self._changed.notify_all()
            return self._now

    def advance(self, seconds: float) -> None:
        with self._changed:
            self._now += seconds

    @property
    def reads(self) -> int:
        with self._changed:
            return self._reads

    def wait_reads(self, count: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self._reads >= count, HANG_S)


def _answer(connection: socket.socket) -> bytes:
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    return answer


def _answered(connection: socket.socket) -> bool:
    """Whether anything (an answer, the close) came on ``connection`` yet."""
    readable, _, _ = select.select([connection], [], [], 0)
    return bool(readable)


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as connection:
        connection.sendall(request)
        return _answer(connection)


@pytest.fixture
def served() -> Iterator[tuple[MetricsExporter, _Counting, _Clock, int]]:
    source, clock = _Counting(), _Clock()
    exporter = MetricsExporter(MetricsConfig(listen="127.0.0.1:0"), source, clock)
    exporter.start()
    try:
        port = int(exporter.describe()["listen"].rsplit(":", 1)[1])
        yield exporter, source, clock, port
    finally:
        exporter.stop()


def test_a_scrape_flood_collects_once_per_cache_interval(
    served: tuple[MetricsExporter, _Counting, _Clock, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter, source, clock, port = served
    # The rest between connections is the next test's: here each scrape is served
    # as soon as the last ended, and the clock moves by what the rest would allow.
    monkeypatch.setattr(metrics_http, "MIN_REQUEST_GAP_S", 0.0)
    step, scrapes = 0.02, 200
    for index in range(scrapes):
        openmetrics = index % 2 == 1  # both formats, served from one collection
        head, _, body = _exchange(port, OPENMETRICS if openmetrics else SCRAPE).partition(
            b"\r\n\r\n"
        )
        assert head.startswith(b"HTTP/1.0 200 "), head
        assert body.endswith(b"# EOF\n") == openmetrics
        clock.advance(step)
    elapsed = scrapes * step  # 4 s of the exporter's clock
    # One collection per SCRAPE_CACHE_S (the first scrape's, then one each time the
    # last is that old): 4 or 5 here, where each scrape collected (200) before.
    assert elapsed // SCRAPE_CACHE_S <= source.calls <= math.ceil(elapsed / SCRAPE_CACHE_S) + 1
    assert exporter.describe()["requests"] == {"scrape": scrapes}


def test_after_each_connection_the_listener_rests(
    served: tuple[MetricsExporter, _Counting, _Clock, int],
) -> None:
    exporter, source, clock, port = served
    assert _exchange(port, SCRAPE).startswith(b"HTTP/1.0 200 ")
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as queued:
        queued.sendall(SCRAPE)  # in the listen backlog: the kernel finished the handshake
        # The thread looks at its clock twice per turn of its loop: three turns at
        # least, each of which would have served it without the rest.
        clock.wait_reads(clock.reads + 7)
        assert not _answered(queued)
        assert exporter.describe()["requests"] == {"scrape": 1}
        clock.advance(metrics_http.MIN_REQUEST_GAP_S)
        assert _answer(queued).startswith(b"HTTP/1.0 200 ")
    assert exporter.describe()["requests"] == {"scrape": 2}
    assert source.calls == 1  # the second from the first's collection, 20 ms old
    # Whatever a connection asked, the listener rests after it: a 404 too.
    clock.advance(metrics_http.MIN_REQUEST_GAP_S)
    assert _exchange(port, b"GET /other HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 404 ")
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as queued:
        queued.sendall(b"GET /other HTTP/1.0\r\n\r\n")
        clock.wait_reads(clock.reads + 7)
        assert not _answered(queued)
        clock.advance(metrics_http.MIN_REQUEST_GAP_S)
        assert _answer(queued).startswith(b"HTTP/1.0 404 ")
    assert exporter.describe()["requests"] == {"scrape": 2, "not_found": 2}
