"""The metrics HTTP endpoint: ``GET /metrics`` and nothing else, bounded.

One connection at a time on the exporter's thread (``socketserver.TCPServer``,
no thread per connection), a listen backlog of ``BACKLOG``; a request's head
(request line and headers) must arrive within ``READ_DEADLINE_S`` in at most
``MAX_REQUEST_BYTES``, or the connection is closed (431 when too large); the
reply must be taken within ``WRITE_TIMEOUT_S``; HTTP/1.0, so every connection
closes after one reply.  A client can therefore hold the thread for at most
``READ_DEADLINE_S + WRITE_TIMEOUT_S`` and the daemon memory for one request
head.  After each connection the listener is left alone for
``MIN_REQUEST_GAP_S`` (``paused_until``): a flood of connections waits in the
listen backlog (past it the kernel drops their SYNs and the clients retry)
instead of taking the GIL from the engine workers.  Nothing is logged per
request: the exporter counts them.  An ``accept`` that fails (the daemon out of
descriptors) leaves the listener alone for ``ACCEPT_PAUSE_S``, logged as
``metrics_accept_failed``.  Empty lines before the request line are ignored
(RFC 9112 section 2.2), counted in ``MAX_REQUEST_BYTES`` with the head.  A
request line other than ``METHOD TARGET HTTP/1.x`` (HTTP/0.9's two words,
garbage, an empty line before the peer closed its side) is answered 400 with a
status line and headers (``default_request_version``).

The body is OpenMetrics when the scraper asks for it (Prometheus does, in its
``Accept`` header), else Prometheus' text format (``prometheus_client``'s
``choose_encoder``).
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from io import BytesIO
from typing import Any, Protocol
from urllib.parse import urlsplit

import structlog

MAX_REQUEST_BYTES = 8192
READ_DEADLINE_S = 2.0
WRITE_TIMEOUT_S = 5.0
BACKLOG = 8
METRICS_PATH = "/metrics"
#: Every reply's ``Server`` header: no version of the daemon or the interpreter.
SERVER = "inferd"
#: How long the listener is left alone after ``accept`` failed (``EMFILE``,
#: ``ENFILE``, ``ENOMEM``): the connection stays queued and the listener readable,
#: so trying again at once spins the thread (as ``shm.sock``'s, DESIGN.md 200).
ACCEPT_PAUSE_S = 0.5
#: How long the listener is left alone after each connection, whatever it asked:
#: at most 50 connections a second, so serving them (about 0.3 ms each once the
#: body is cached, ``exporter.SCRAPE_CACHE_S``) costs at most a few percent of a
#: core and of the GIL.  A scraper queued behind others (``BACKLOG``) waits this
#: long per connection ahead of it, on top of each one's own service time (up to
#: ``READ_DEADLINE_S + WRITE_TIMEOUT_S``, 7 s, for a client that sends nothing).
MIN_REQUEST_GAP_S = 0.02

log = structlog.get_logger("inferd.metrics")

#: ``render(accept_header) -> (body, content_type)``.
Render = Callable[[str], tuple[bytes, str]]
#: A monotonic clock, seconds (``time.monotonic``; a test's own).
Clock = Callable[[], float]


class Count(Protocol):
    """``count(outcome)``: ``scrape``, ``not_found``, ``bad_method``, ``too_large``,
    ``bad_request``, ``timeout`` (the head not received or the reply not taken in
    time), ``error``; ``instead_of``: the outcome counted for that request before."""

    def __call__(self, outcome: str, instead_of: str | None = None) -> None: ...


#: The outcome of each error ``BaseHTTPRequestHandler`` answers itself while parsing
#: a request (501: a method other than GET; 431: over 100 headers); any other
#: (400: a malformed request line or header, 505: an HTTP version it does not speak)
#: is ``bad_request``.
_PARSE_ERRORS = {501: "bad_method", 431: "too_large"}
_PLAIN = "text/plain; charset=utf-8"


class _TooLarge(Exception):
    pass


def _request_line_at(head: bytes) -> int:
    """Where the request line begins in ``head``: after the empty lines (CRLF, or a
    bare LF) before it, which RFC 9112 section 2.2 says a server SHOULD ignore (old
    clients send one after a POST's body)."""
    start = 0
    while True:
        if head.startswith(b"\r\n", start):
            start += 2
        elif head.startswith(b"\n", start):
            start += 1
        else:
            return start


def read_head(connection: socket.socket, deadline: float, limit: int) -> bytes:
    """The bytes of a request from its request line up to and including the blank
    line after its headers; the empty lines before the request line are dropped,
    and count against ``limit`` (so a peer that sends only those is bounded too).

    ``TimeoutError`` when ``deadline`` (monotonic) passes first, ``_TooLarge``
    past ``limit`` bytes; what the peer sent before closing otherwise (one empty
    line when it sent empty lines alone: a blank request line, answered 400)."""
    head = b""
    skipped = 0  # the empty lines before the request line, in bytes
    while b"\r\n\r\n" not in head and b"\n\n" not in head:
        if skipped + len(head) > limit:
            raise _TooLarge
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request head not received in time")
        connection.settimeout(remaining)
        chunk = connection.recv(min(4096, limit + 1 - skipped - len(head)))
        if not chunk:
            return head if head or not skipped else b"\r\n"
        head += chunk
        start = _request_line_at(head)  # 0 at once once the request line began
        if start:
            skipped += start
            head = head[start:]
    if skipped + len(head) > limit:
        raise _TooLarge
    return head


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    #: The version of a reply to a request line that names none, or none the stdlib
    #: could parse: its own default, HTTP/0.9, sends an error as a bare HTML body
    #: with no status line, which no HTTP client reads as an error.
    default_request_version = "HTTP/1.0"
    timeout = WRITE_TIMEOUT_S  # StreamRequestHandler sets it on the socket
    server: MetricsServer

    def handle(self) -> None:
        try:
            head = read_head(self.connection, time.monotonic() + READ_DEADLINE_S, MAX_REQUEST_BYTES)
        except _TooLarge:
            self.server.count("too_large")
            self._raw(b"431 Request Header Fields Too Large")
            return
        except TimeoutError:
            self.server.count("timeout")
            return
        self.connection.settimeout(WRITE_TIMEOUT_S)
        self.rfile = BytesIO(head)
        self.handle_one_request()

    def _raw(self, status: bytes) -> None:
        self.connection.settimeout(WRITE_TIMEOUT_S)
        reply = b"HTTP/1.0 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        with contextlib.suppress(OSError):  # the peer left: nothing more to tell it
            self.wfile.write(reply)

    def parse_request(self) -> bool:
        """The stdlib's parse, less what it takes for HTTP/0.9 (``GET /metrics``, no
        version: served as a bare body) or ignores (a blank request line: no reply
        at all); both are ``bad_request``, as an HTTP version other than 1.x is."""
        parsed = super().parse_request()
        words = self.requestline.split()  # set first thing, whatever it refuses
        if not parsed:
            if not words:  # the one refusal the stdlib does not answer
                self.send_error(HTTPStatus.BAD_REQUEST, "Empty request line")
            return False
        if len(words) == 2:
            self.send_error(
                HTTPStatus.BAD_REQUEST, "HTTP/0.9 is not served: send GET /metrics HTTP/1.0"
            )
            return False
        return True

    def do_GET(self) -> None:
        try:
            path = urlsplit(self.path).path
        except ValueError:  # "http://[/metrics": urlsplit refuses the authority
            self.send_error(400, "Bad request target")
            return
        if path != METRICS_PATH:
            self._reply(404, b"only /metrics is served here\n", _PLAIN, "not_found")
            return
        try:
            body, content_type = self.server.render(self.headers.get("Accept", ""))
        except Exception:  # the exporter logged it and keeps it as its last error
            self._reply(500, b"collecting the metrics failed\n", _PLAIN, "error")
            return
        self._reply(200, body, content_type, "scrape")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        with self._answering(_PARSE_ERRORS.get(code, "bad_request")):
            super().send_error(code, message, explain)

    def _reply(self, code: int, body: bytes, content_type: str, outcome: str) -> None:
        with self._answering(outcome):
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    @contextlib.contextmanager
    def _answering(self, outcome: str) -> Iterator[None]:
        """Counts ``outcome`` before the reply (a client that read it sees it
        counted); a reply not taken within ``WRITE_TIMEOUT_S`` becomes a
        ``timeout`` (``handle_one_request`` would swallow it, the request left
        counted as answered), one whose peer left an ``error`` (not counted twice
        by ``handle_error``)."""
        self.server.count(outcome)
        try:
            yield
        except TimeoutError:
            self.server.count("timeout", instead_of=outcome)
            self.close_connection = True
        except OSError:
            self.server.count("error", instead_of=outcome)
            self.close_connection = True

    def version_string(self) -> str:
        """The ``Server`` header: the stdlib's names the Python version
        (``BaseHTTP/0.6 Python/3.11.7``), which a scraper has no use for."""
        return SERVER

    def log_message(self, format: str, *args: Any) -> None:
        return None  # nothing per request: the exporter counts outcomes


class MetricsServer(socketserver.TCPServer):
    """Serves one request per ``handle_request()`` call, on the caller's thread."""

    allow_reuse_address = True
    request_queue_size = BACKLOG

    def __init__(
        self, address: tuple[str, int], render: Render, count: Count, clock: Clock = time.monotonic
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.render = render
        self.count = count
        self.clock = clock
        #: Until when (``clock``) no connection is accepted: ``MIN_REQUEST_GAP_S``
        #: after the last one, ``ACCEPT_PAUSE_S`` after an ``accept`` failed.
        self.paused_until = 0.0
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return self.socket.accept()
        except (BlockingIOError, InterruptedError):
            raise  # nothing to accept after all: ``handle_request`` returns
        except OSError as exc:  # out of descriptors or memory: not again at once
            self.paused_until = self.clock() + ACCEPT_PAUSE_S
            log.warning("metrics_accept_failed", error=exc.strerror, retry_s=ACCEPT_PAUSE_S)
            raise

    def shutdown_request(self, request: Any) -> None:
        """After every connection accepted, whatever became of it (``socketserver``
        calls this last): the rest is set before the close, which is where a client
        sees the end of its reply."""
        self.paused_until = max(self.paused_until, self.clock() + MIN_REQUEST_GAP_S)
        super().shutdown_request(request)

    @property
    def bound(self) -> str:
        """``HOST:PORT`` actually bound (the port chosen when the config said 0)."""
        host, port = self.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else str(host)
        return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that vanished mid-reply, or a failed collection (already counted).
        self.count("error")
