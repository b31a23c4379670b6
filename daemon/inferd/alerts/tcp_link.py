"""The byte stream behind a ``tcp:`` MAVLink hook, owned here rather than by pymavlink.

pymavlink's ``mavtcp`` does not fit an alert hook: it connects in its
constructor with retries and no timeout (minutes of start-up against an
unreachable ground station), its ``write`` swallows ``EPIPE`` and
``ECONNRESET`` (with ``autoreconnect=False`` every later frame silently goes
nowhere) and it prints to stdout.  This link never waits on the network in the
caller: connecting happens on a background thread with a bounded timeout,
sends are non-blocking, and every frame that cannot be handed to the kernel
raises ``OSError`` so the dispatcher counts it as a failure.
"""

from __future__ import annotations

import socket
import threading

import structlog

log = structlog.get_logger("inferd.alerts.mavlink")

#: Bound on one connection attempt (a blackholed ground station never answers).
CONNECT_TIMEOUT_S = 2.0
#: Pause between attempts while the ground station cannot be reached.
RETRY_INTERVAL_S = 5.0
CONNECT_THREAD_NAME = "inferd-mavlink-connect"
#: Reads per send to discard what the ground station sends us (heartbeats).
_MAX_DRAIN_READS = 64
_READ_SIZE = 4096


class TcpLink:
    """A TCP connection to ``host:port`` that reconnects on its own.

    ``write`` (pymavlink's encoder calls it once per frame) sends the whole
    frame or raises ``OSError``: while disconnected, when the peer has closed
    the connection, or when the kernel cannot take the frame at once.  A failed
    send drops the connection (a frame may be torn) and starts reconnecting;
    at most one connecting thread runs at a time.  Thread-safe.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        retry_interval_s: float = RETRY_INTERVAL_S,
    ) -> None:
        self.address = (host, port)
        self.endpoint = f"tcp:{host}:{port}"
        self._connect_timeout_s = connect_timeout_s
        self._retry_interval_s = retry_interval_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._connector: threading.Thread | None = None
        self._last_error = "not connected yet"
        with self._lock:
            self._start_connector()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def write(self, data: bytes) -> None:
        with self._lock:
            sock = self._sock
            if sock is None:
                self._start_connector()
                raise ConnectionError(f"not connected to {self.endpoint} ({self._last_error})")
            try:
                _discard_received(sock)
                sock.sendall(data)
            except OSError as exc:
                self._sock = None
                sock.close()
                self._last_error = repr(exc)
                self._start_connector()
                raise

    def close(self) -> None:
        """Close the connection and wait (one connect timeout at most) for a connecting
        thread: nothing of the link outlives its hook."""
        self._closed.set()
        with self._lock:
            sock, self._sock = self._sock, None
            connector = self._connector
        if sock is not None:
            sock.close()
        if connector is not None and connector is not threading.current_thread():
            connector.join(self._connect_timeout_s + 1.0)

    def _start_connector(self) -> None:
        """Call with the lock held."""
        if self._connector is not None or self._closed.is_set():
            return
        self._connector = threading.Thread(
            target=self._connect_until_up, name=CONNECT_THREAD_NAME, daemon=True
        )
        self._connector.start()

    def _connect_until_up(self) -> None:
        try:
            self._connect_loop()
        finally:  # however it ended, a later write may start another
            with self._lock:
                if self._connector is threading.current_thread():
                    self._connector = None

    def _connect_loop(self) -> None:
        attempts = 0
        while not self._closed.is_set():
            attempts += 1
            try:
                sock = socket.create_connection(self.address, timeout=self._connect_timeout_s)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except Exception as exc:  # OSError, and a host getaddrinfo cannot encode
                with self._lock:
                    self._last_error = repr(exc)
                if self._closed.is_set():
                    return  # closed while connecting: nothing to report
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
                self._connector = None  # with the socket: a failing write starts the next
                if self._closed.is_set():
                    sock.close()
                    return
                self._sock = sock
            log.info("mavlink_tcp_connected", endpoint=self.endpoint, attempts=attempts)
            return


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
