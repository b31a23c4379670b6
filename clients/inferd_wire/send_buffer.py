"""The kernel send buffer of a ZeroMQ socket's connections (DESIGN.md 116).

A Unix stream socket holds at most ``SO_SNDBUF`` bytes that its reader has not
taken (``net.core.wmem_default``: 208 KiB on Linux) before its writer must
wait.  ZeroMQ's I/O threads then pass a 0.6 MB tensor in four writes, and
each side's I/O thread wakes three or four times per message instead of once.
libzmq applies ``ZMQ_SNDBUF`` to ``tcp://`` connections only, so for ``ipc://``
``SendBuffer`` sets ``SO_SNDBUF`` on each connection itself, as the socket's
monitor reports it: ``ZMQ_EVENT_CONNECTED`` and ``ZMQ_EVENT_ACCEPTED`` carry the
connection's descriptor.  A ``tcp://`` socket is left alone: a size set on a
TCP socket turns the kernel's own tuning of its buffers off.

The descriptor may have been closed, and its number reused, by the time the
event is read: a descriptor is touched only when it is a Unix stream socket
whose address is this endpoint's path, so the worst a stale event can do is
size another connection of the same endpoint, which is sized anyway.

The kernel caps the size at ``net.core.wmem_max`` (and keeps twice the value
asked for its own bookkeeping); ``effective_bytes`` is what the last
connection got, and a cap is logged once by the caller (``capped``).
"""

from __future__ import annotations

import socket
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd_wire.endpoints import MAX_SEND_BUFFER_BYTES
from inferd_wire.multipart import readable

#: The monitor's events that carry a connection's descriptor (``size`` takes it).
CONNECTION_EVENTS = int(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)


def _ipc_address(endpoint: str) -> str | bytes | None:
    """The address ``getsockname``/``getpeername`` give for an ``ipc://`` endpoint
    (an abstract one, ``ipc://@name``, as bytes); None for another transport."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    return b"\0" + path[1:].encode() if path.startswith("@") else path


class SendBuffer:
    """Sizes the send buffer of every ``ipc://`` connection a socket makes or accepts.

    ``watch`` the socket before it binds or connects; call ``apply`` often (the
    daemon's bus thread on each pass of its loop: one ``ZMQ_EVENTS`` look when
    nothing is new); ``close`` before the socket.  ``nbytes`` 0 leaves the
    kernel's default.  libzmq allows one monitor per socket: a client's request
    socket has its ``ConnectionWatch`` (``inferd_client.connection_watch``),
    which asks for these events too and hands each descriptor to ``size``, in
    place of ``watch`` and ``apply``.
    """

    def __init__(self, endpoint: str, nbytes: int) -> None:
        if not 0 <= nbytes <= MAX_SEND_BUFFER_BYTES:
            raise ValueError(f"send_buffer_bytes must be 0..{MAX_SEND_BUFFER_BYTES}, got {nbytes}")
        self.nbytes = nbytes
        #: Connections sized, and how many of them the kernel capped below ``nbytes``.
        self.sized = 0
        self.capped = 0
        #: What the last connection sized got (``getsockopt(SO_SNDBUF)`` / 2).
        self.effective_bytes: int | None = None
        self._address = _ipc_address(endpoint)
        self._sock: zmq.Socket[Any] | None = None
        self.monitor: zmq.Socket[Any] | None = None

    @property
    def sizes(self) -> bool:
        """Whether connections are sized at all (``nbytes`` set, an ``ipc://``
        endpoint): whether a monitor must report them."""
        return self.nbytes != 0 and self._address is not None

    def watch(self, sock: zmq.Socket[Any]) -> None:
        """Size ``sock``'s connections from now on (call before it binds or connects)."""
        if not self.sizes:
            return
        self._sock = sock
        self.monitor = sock.get_monitor_socket(CONNECTION_EVENTS)

    def apply(self) -> int:
        """Size the connections the monitor has reported since the last call; how
        many were sized."""
        monitor = self.monitor
        if monitor is None or not readable(monitor):
            return 0
        sized = 0
        while True:
            try:
                parts = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return sized
            event = parse_monitor_message(parts)
            if event["event"] & CONNECTION_EVENTS and self.size(int(event["value"])):
                sized += 1

    def size(self, fd: int) -> bool:
        """Size the connection ``fd`` names if it is one of this endpoint's (a
        Unix stream socket bound or connected to its path); whether it was."""
        try:
            conn = socket.socket(fileno=fd)  # fails on a descriptor that is no socket
        except OSError:
            return False
        try:
            if conn.family != socket.AF_UNIX or conn.type != socket.SOCK_STREAM:
                return False
            if self._address not in (conn.getsockname(), conn.getpeername()):
                return False
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.nbytes)
            effective = conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        except OSError:
            return False  # closed meanwhile
        finally:
            conn.detach()  # the descriptor stays ZeroMQ's
        self.sized += 1
        self.effective_bytes = effective
        if effective < self.nbytes:
            self.capped += 1
        return True

    def status(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes,
            "sized": self.sized,
            "capped": self.capped,
            "effective_bytes": self.effective_bytes,
        }

    def close(self) -> None:
        """Stop monitoring (before the socket closes)."""
        if self.monitor is not None and self._sock is not None:
            self._sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
