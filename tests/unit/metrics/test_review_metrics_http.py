"""A review of the metrics endpoint (``metrics/http.py``, ``metrics/exporter.py``):
what a client sends or does may not change what the endpoint says about itself
beyond its own request, nor flood the journal.

- A reply not taken within ``WRITE_TIMEOUT_S`` was counted as a ``scrape``:
  ``BaseHTTPRequestHandler.handle_one_request`` swallows the ``TimeoutError``.
- A peer that left mid-reply was counted twice (``scrape`` and ``error``).
- A request target ``urlsplit`` refuses (``http://[/metrics``) got no reply at
  all and was counted as ``error`` (a failed collection).
- ``choose_encoder`` copies the OpenMetrics version the scraper names, any text,
  into ``Content-Type``: a folded ``Accept`` header came back as a header line
  of the reply, and the body (OpenMetrics 1.0.0) was labelled ``version=2.x``.
- A collection that fails logged a traceback at ERROR for every scrape (2,016 in
  1 s from one local client), and ``status.metrics.last_error`` kept it after
  collections succeeded again, where the schema says it is null once one does.
- A request line the stdlib could not parse (garbage, HTTP/2.0) was answered with
  the bare HTML of an error, no status line and no headers (its default version,
  HTTP/0.9); a two-word ``GET /metrics`` was served as an HTTP/0.9 scrape (the body
  alone) and counted ``scrape``; a blank request line got nothing and was not
  counted.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from inferd.config import MetricsConfig
from inferd.metrics import MetricsExporter
from inferd.metrics import http as metrics_http
from inferd.metrics.http import MetricsServer
from tests.conftest import HANG_S
from tests.unit.metrics.test_families import status as status_document


class _Source:
    """A daemon whose ``status`` is a fixed document, or fails while ``failing``."""

    slots: Mapping[str, Any] = {}

    def __init__(self) -> None:
        self.failing = False

    def status(self, _header: dict[str, Any]) -> dict[str, Any]:
        if self.failing:
            raise RuntimeError("a piece of status broke")
        return status_document()


class _Outcomes:
    """``MetricsServer``'s ``count``, kept as the exporter keeps it."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def __call__(self, outcome: str, instead_of: str | None = None) -> None:
        if instead_of is not None:
            self.counts[instead_of] -= 1
        self.counts[outcome] += 1

    def seen(self) -> dict[str, int]:
        return {outcome: n for outcome, n in self.counts.items() if n}


@pytest.fixture
def exporter() -> Iterator[tuple[MetricsExporter, _Source, int]]:
    source = _Source()
    exporter = MetricsExporter(MetricsConfig(listen="127.0.0.1:0"), source)
    exporter.start()
    try:
        yield exporter, source, int(exporter.describe()["listen"].rsplit(":", 1)[1])
    finally:
        exporter.stop()


def _exchange(port: int, request: bytes, *, half_close: bool = False) -> bytes:
    """All the endpoint answered ``request`` until it closed the connection (so
    the request is counted by then); ``half_close``: the client's side is shut
    after the request (nothing more will come)."""
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as connection:
        connection.sendall(request)
        if half_close:
            connection.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    return answer


def _served(server: MetricsServer) -> None:
    """One connection, already queued, served on this thread."""
    server.timeout = HANG_S
    done = threading.Event()
    server.handle_timeout = done.set  # type: ignore[method-assign]
    server.handle_request()
    assert not done.is_set(), "no connection was queued"


def test_a_reply_not_taken_in_time_is_a_timeout_not_a_scrape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics_http, "WRITE_TIMEOUT_S", 0.2)  # the bound, not a wait
    outcomes = _Outcomes()
    body = b"x" * (32 << 20)  # more than loopback's buffers hold for a peer that never reads
    server = MetricsServer(("127.0.0.1", 0), lambda _accept: (body, "text/plain"), outcomes)
    try:
        with socket.socket() as slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            slow.connect(server.server_address)
            slow.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            _served(server)  # returns once the write gave up
    finally:
        server.server_close()
    assert outcomes.seen() == {"timeout": 1}


def test_a_peer_that_left_mid_reply_is_counted_once_as_an_error() -> None:
    outcomes = _Outcomes()
    body = b"x" * (20 << 20)
    server = MetricsServer(("127.0.0.1", 0), lambda _accept: (body, "text/plain"), outcomes)
    try:
        gone = socket.create_connection(server.server_address)
        gone.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        gone.close()  # a reset: the reply's write fails
        _served(server)
    finally:
        server.server_close()
    assert outcomes.seen() == {"error": 1}


def test_a_request_target_urlsplit_refuses_is_answered_400(
    exporter: tuple[MetricsExporter, _Source, int],
) -> None:
    metrics, _source, port = exporter
    answer = _exchange(port, b"GET http://[/metrics HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 400 "), answer
    assert metrics.describe()["requests"] == {"bad_request": 1}
    assert metrics.describe()["last_error"] is None


def test_the_content_type_names_the_openmetrics_version_served_not_the_one_asked(
    exporter: tuple[MetricsExporter, _Source, int],
) -> None:
    _metrics, _source, port = exporter
    accept = b"Accept: application/openmetrics-text; version=2.x\r\n X-Injected: yes\r\n"
    answer = _exchange(port, b"GET /metrics HTTP/1.0\r\n" + accept + b"\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 "), head
    assert b"X-Injected" not in head and b"2.x" not in head
    assert (
        b"\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8;"
        b" escaping=underscores\r\n" in head
    )
    assert body.endswith(b"# EOF\n")
    names = {family.name for family in text_string_to_metric_families(body.decode())}
    assert "inferd_uptime_seconds" in names
    # What Prometheus 3 asks for is served as it was.
    prometheus = (
        b"Accept: application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
        b"application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=0.0.4;q=0.3\r\n"
    )
    head = _exchange(port, b"GET /metrics HTTP/1.0\r\n" + prometheus + b"\r\n").partition(
        b"\r\n\r\n"
    )[0]
    assert (
        b"\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8;"
        b" escaping=allow-utf-8\r\n" in head
    )


def test_a_failing_collection_is_logged_once_and_forgotten_once_one_succeeds(
    exporter: tuple[MetricsExporter, _Source, int],
) -> None:
    metrics, source, port = exporter
    with capture_logs() as logs:
        source.failing = True
        for _ in range(20):
            assert _exchange(port, b"GET /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 500 ")
        described = metrics.describe()
        assert described["requests"] == {"error": 20}
        assert "a piece of status broke" in described["last_error"]
        source.failing = False
        assert _exchange(port, b"GET /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200 ")
    events = Counter(line["event"] for line in logs)
    assert events["metrics_collect_failed"] == 1, events
    assert events["metrics_collect_restored"] == 1, events
    assert metrics.describe()["last_error"] is None


@pytest.mark.parametrize(
    ("request_line", "status"),
    [
        (b"GET /metrics", b"400"),  # HTTP/0.9
        (b"GARBAGE", b"400"),
        (b"GET /metrics HTTP/1.0 extra", b"400"),
        (b"GET /metrics HTTP/2.0", b"505"),
        (b"", b"400"),
    ],
    ids=["http-0.9", "one-word", "four-words", "http-2", "blank"],
)
def test_a_request_line_that_is_not_http_1_gets_a_status_line_and_is_a_bad_request(
    exporter: tuple[MetricsExporter, _Source, int], request_line: bytes, status: bytes
) -> None:
    metrics, _source, port = exporter
    # Empty lines before a request line are ignored while one may still come: a
    # blank request line is what came when the peer closed its side.
    answer = _exchange(port, request_line + b"\r\n\r\n", half_close=not request_line)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 " + status + b" "), answer[:200]
    headers = head.split(b"\r\n")[1:]
    assert b"Server: inferd" in headers and b"Connection: close" in headers, head
    assert b"# HELP" not in body  # never served
    assert metrics.describe()["requests"] == {"bad_request": 1}


@pytest.mark.parametrize(
    "before",
    [b"\r\n", b"\r\n\n\r\n\r\n"],
    ids=["one-crlf", "several-and-a-bare-lf"],
)
def test_empty_lines_before_the_request_line_are_ignored(
    exporter: tuple[MetricsExporter, _Source, int], before: bytes
) -> None:
    # RFC 9112 section 2.2: a server SHOULD ignore at least one empty line before
    # the request line.  Before: "400 Empty request line", counted bad_request.
    metrics, _source, port = exporter
    answer = _exchange(port, before + b"GET /metrics HTTP/1.0\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 "), answer[:200]
    assert b"# HELP inferd_uptime_seconds" in body
    assert metrics.describe()["requests"] == {"scrape": 1}


def test_an_empty_line_split_between_two_reads_is_ignored_whole() -> None:
    # 4,095 LFs and a CR fill the first read (4,096 bytes): the CR's LF comes in the
    # next, and the two are one empty line, not a request line "\r".
    server, client = socket.socketpair()
    with server, client:
        request = b"GET /metrics HTTP/1.0\r\n\r\n"
        client.sendall(b"\n" * 4095 + b"\r\n" + request)
        head = metrics_http.read_head(server, time.monotonic() + HANG_S, 8192)
    assert head == request


def test_empty_lines_alone_are_bounded_by_the_head_limit_and_the_read_deadline(
    exporter: tuple[MetricsExporter, _Source, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics, _source, port = exporter
    # More empty lines than a head may hold: 431, as an overlong head (before: 400).
    # One byte over, all of it read, so the endpoint's close is no reset.
    flood = b"\r\n" * (metrics_http.MAX_REQUEST_BYTES // 2) + b"\n"
    assert _exchange(port, flood).startswith(b"HTTP/1.0 431 ")
    assert metrics.describe()["requests"] == {"too_large": 1}
    # Empty lines and no request line while the peer stays: the read deadline ends
    # it, no reply, as for a peer that sends nothing (before: 400 at once).
    monkeypatch.setattr(metrics_http, "READ_DEADLINE_S", 0.2)  # the bound, not a wait
    assert _exchange(port, b"\r\n\r\n") == b""
    assert metrics.describe()["requests"] == {"too_large": 1, "timeout": 1}
