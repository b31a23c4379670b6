"""The byte stream behind a ``tcp:`` MAVLink hook, owned here rather than by pymavlink.

pymavlink's ``mavtcp`` does not fit an alert hook: it connects in its
constructor with retries and no timeout (minutes of start-up against an
unreachable ground station), its ``write`` swallows ``EPIPE`` and
``ECONNRESET`` (with ``autoreconnect=False`` every later frame silently goes
nowhere) and it prints to stdout.  This link never waits on the network in the
caller: one thread of its own (``inferd-mavlink-tcp``) connects with a bounded
timeout and then watches the connection, sends are non-blocking, and every
frame that cannot be handed to the kernel raises ``OSError`` so the dispatcher
counts it as a failure.

The thread watches so that a ground station that closed the connection between
alerts (a restart) is reconnected to at once: noticed only by the next alert,
that alert failed, and so did the first alert after the station came back
(DESIGN.md 261).  While it is not connected, ``write`` raises
``NoDestinationError`` (the hook holds the alert) and ``on_connected`` tells the
hook when to send what it holds (``link_backlog``).  An IPv6 ``host`` is given
without brackets.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable

import structlog

from inferd.alerts.link_backlog import NoDestinationError

log = structlog.get_logger("inferd.alerts.mavlink")

#: Bound on one connection attempt (a blackholed ground station never answers).
CONNECT_TIMEOUT_S = 2.0
#: Pause between attempts while the ground station cannot be reached, and the
#: least time between two reconnections after drops (a peer that accepts and
#: closes at once is not a busy loop).
RETRY_INTERVAL_S = 5.0
LINK_THREAD_NAME = "inferd-mavlink-tcp"
#: A ground station that vanishes without closing (power lost, out of radio range)
#: sends no FIN: kernel keepalives probe an idle connection after this long, every
#: ``KEEPALIVE_INTERVAL_S``, and end it after ``KEEPALIVE_PROBES`` unanswered (11 s),
#: and frames the station has not acknowledged end it after ``USER_TIMEOUT_S``.  The
#: watcher then sees the error and connects again; Linux's defaults took 2 h idle and
#: about 15 min with frames unacknowledged, all of them counted as sent.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3
USER_TIMEOUT_S = 10
#: Reads per wake-up or send to discard what the ground station sends us (heartbeats).
_MAX_DRAIN_READS = 64
_READ_SIZE = 4096


class TcpLink:
    """A TCP connection to ``host:port`` that reconnects on its own.

    ``write`` (pymavlink's encoder calls it once per frame) sends the whole
    frame or raises ``OSError``: while disconnected, when the peer has closed
    the connection, or when the kernel cannot take the frame at once.  One
    thread connects, then reads (and discards) what the peer sends as it
    arrives; when the peer closes the connection or a send fails (a frame may
    be torn), it closes the socket and connects again: at once after a drop,
    every ``retry_interval_s`` while that fails.  Only that thread closes a
    socket it polls, so no descriptor is reused under it; ``write`` and
    ``close`` wake it with ``shutdown``.  Thread-safe.  ``on_connected`` is
    called on that thread after each connection, with no lock of this class held.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        retry_interval_s: float = RETRY_INTERVAL_S,
        on_connected: Callable[[], None] | None = None,
    ) -> None:
        self.address = (host, port)
        self.endpoint = f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"
        self._on_connected = on_connected
        self._connect_timeout_s = connect_timeout_s
        self._retry_interval_s = retry_interval_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: The connection writes use; None while down.
        self._sock: socket.socket | None = None
        #: The connection the thread polls and alone closes (still set once dropped).
        self._watched: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._last_error = "not connected yet"
        with self._lock:
            self._start_thread()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def last_error(self) -> str | None:
        """Why the link is down; None while it is up."""
        with self._lock:
            return None if self._sock is not None else self._last_error

    def write(self, data: bytes) -> None:
        with self._lock:
            sock = self._sock
            if sock is None:
                self._start_thread()  # only if it died (a bug): it reconnects on its own
                raise NoDestinationError(f"not connected to {self.endpoint} ({self._last_error})")
            try:
                _discard_received(sock)  # a close the thread has not seen yet
            except OSError as exc:  # nothing of this frame was sent: the link is down
                self._drop(sock, repr(exc))
                raise NoDestinationError(f"{self.endpoint}: {exc}") from exc
            try:
                sock.sendall(data)
            except OSError as exc:
                self._drop(sock, repr(exc))
                raise

    def close(self) -> None:
        """End the thread, which closes the connection: at once while connected or
        waiting to retry, one connect timeout at most while connecting."""
        self._closed.set()
        with self._lock:
            self._sock = None
            thread, watched = self._thread, self._watched
            if watched is not None:
                _wake(watched)
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._connect_timeout_s + 1.0)

    def _drop(self, sock: socket.socket, error: str) -> None:
        """Take ``sock`` from the writers and wake the thread, which closes it and
        reconnects.  Call with the lock held."""
        if self._sock is sock:
            self._sock = None
        self._last_error = error
        _wake(sock)

    def _start_thread(self) -> None:
        """Call with the lock held; raises if the thread cannot start."""
        if self._thread is not None or self._closed.is_set():
            return
        thread = threading.Thread(target=self._run, name=LINK_THREAD_NAME, daemon=True)
        self._thread = thread
        try:
            thread.start()
        except BaseException:
            self._thread = None
            raise

    def _run(self) -> None:
        try:
            dropped_at: float | None = None
            while (sock := self._connect()) is not None:
                error = self._watch(sock)
                with self._lock:
                    if self._sock is sock:
                        self._sock = None
                    self._watched = None
                sock.close()
                if self._closed.is_set():
                    return
                log.warning("mavlink_tcp_disconnected", endpoint=self.endpoint, error=error)
                now = time.monotonic()
                pause = 0.0 if dropped_at is None else dropped_at + self._retry_interval_s - now
                if pause > 0 and self._closed.wait(pause):  # not twice within a retry interval
                    return
                dropped_at = now
        finally:  # however it ended, nothing it owned outlives it, and a write may start another
            with self._lock:
                watched, self._watched = self._watched, None
                if self._sock is watched:
                    self._sock = None
                if self._thread is threading.current_thread():
                    self._thread = None
            if watched is not None:
                watched.close()

    def _connect(self) -> socket.socket | None:
        """Connect, trying again every retry interval; None once the link is closed."""
        attempts = 0
        while not self._closed.is_set():
            attempts += 1
            try:
                sock = _open(self.address, self._connect_timeout_s)
            except Exception as exc:  # OSError, and a host getaddrinfo cannot encode
                with self._lock:
                    self._last_error = repr(exc)
                if self._closed.is_set():
                    return None  # closed while connecting: nothing to report
                if attempts == 1:  # once per outage: the dispatcher reports each lost alert
                    log.warning(
                        "mavlink_tcp_connect_failed",
                        endpoint=self.endpoint,
                        error=repr(exc),
                        retry_interval_s=self._retry_interval_s,
                    )
                self._closed.wait(self._retry_interval_s)
                continue
            with self._lock:
                if self._closed.is_set():
                    sock.close()
                    return None
                self._sock = self._watched = sock
            log.info("mavlink_tcp_connected", endpoint=self.endpoint, attempts=attempts)
            if self._on_connected is not None:
                self._on_connected()
            return sock
        return None

    def _watch(self, sock: socket.socket) -> str:
        """Read what the peer sends until the connection drops; returns why."""
        poller = select.poll()  # not select(): the daemon's descriptors may pass 1024
        poller.register(sock, select.POLLIN)  # POLLHUP and POLLERR come unasked
        while True:
            events = poller.poll()
            with self._lock:
                if self._closed.is_set():
                    return "closed"
                if self._sock is not sock:  # a send failed and woke us
                    return self._last_error
                if any(event & select.POLLNVAL for _, event in events):
                    self._sock = None  # closed under it: a bug, but never a busy loop
                    return "the socket was closed under its watcher"
                try:
                    _discard_received(sock)
                except OSError as exc:
                    self._drop(sock, repr(exc))
                    return self._last_error


def _open(address: tuple[str, int], timeout_s: float) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_S * 1000)
    except BaseException:
        sock.close()
        raise
    return sock


def _wake(sock: socket.socket) -> None:
    """Wake the thread polling ``sock``: a shut-down socket stays readable (EOF)."""
    with contextlib.suppress(OSError):  # already reset by the peer: readable already
        sock.shutdown(socket.SHUT_RDWR)


def _discard_received(sock: socket.socket) -> None:
    """Reads what the peer sent (the hook only talks) so its sends never stall,
    and raises if it has closed the connection: found before a send, not
    after the kernel accepted a frame nobody will read."""
    for _ in range(_MAX_DRAIN_READS):
        try:
            data = sock.recv(_READ_SIZE)
        except BlockingIOError:
            return
        if not data:
            raise ConnectionResetError("the ground station closed the connection")
