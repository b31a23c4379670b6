"""``ConnectionWatch``: what a client socket learns of its connection to the
daemon from its monitor, and its connection made again where libzmq will not
(DESIGN.md 238 for the event subscriber; the request channel's too).

A frame longer than the socket's ``ZMQ_MAXMSGSIZE`` ends its connection in
libzmq as its length arrives, before the body is read; libzmq treats that as a
protocol error and, unlike after the peer's disconnect, never connects again
nor counts it.  A subscriber would then wait for good, and a DEALER with
``ZMQ_IMMEDIATE`` has no connection left to send on: every later request times
out.  The watch reads the monitor's news (``HANDSHAKE_SUCCEEDED``,
``DISCONNECTED``, ``CONNECT_RETRIED``), counts each connection that ended once
up, and connects again when libzmq is not retrying.  It also keeps the status
of a handshake the daemon's ZAP handler refused (``HANDSHAKE_FAILED_AUTH``):
libzmq gives such a connection one more try and then none, so a caller that
waited for it would wait out its whole timeout.

libzmq allows one monitor per socket, so a socket whose ``ipc://`` connections
``SendBuffer`` sizes shares this one: the watch also asks for its events
(``CONNECTED``, ``ACCEPTED``) and hands each descriptor to ``SendBuffer.size``.
"""

from __future__ import annotations

import contextlib
import itertools
import select
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd_client.endpoint_trust import connect
from inferd_wire.send_buffer import CONNECTION_EVENTS, SendBuffer

#: What CURVE adds around a frame: it travels in a MESSAGE command 33 bytes
#: longer, and ``ZMQ_MAXMSGSIZE`` bounds that command (measured: a 64 KiB
#: payload needs 65569 bytes).
CURVE_FRAME_OVERHEAD = 33
#: The largest ``ZMQ_MAXMSGSIZE`` (an int64), less CURVE's overhead.
MAX_FRAME_BOUND = 2**63 - 1 - CURVE_FRAME_OVERHEAD

_NOBLOCK = int(zmq.NOBLOCK)
_UP, _DOWN, _RETRYING, _REFUSED = (
    int(zmq.EVENT_HANDSHAKE_SUCCEEDED),
    int(zmq.EVENT_DISCONNECTED),
    int(zmq.EVENT_CONNECT_RETRIED),
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH),
)
_MONITORED = _UP | _DOWN | _RETRYING | _REFUSED
#: Names each monitor's endpoint (``inproc://``, one per context): never a
#: descriptor's number, which a closed socket's successor may reuse.
_monitors = itertools.count()


class ConnectionWatch:
    """The monitor of one client socket that connects to ``endpoint``: made before
    the socket connects (to see the first handshake), read with ``check``,
    closed before the socket.  ``monitor`` is for the caller's ``SocketWait``:
    a wait ends on its news too.  ``reconnect`` False leaves connecting again
    to the caller (the request channel makes its socket anew)."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        endpoint: str,
        send_buffer: SendBuffer | None = None,
        *,
        reconnect: bool = True,
    ) -> None:
        self._socket = sock
        self._endpoint = endpoint
        #: False: the caller makes its socket anew after a lost connection instead.
        self._reconnect = reconnect
        self._send_buffer = send_buffer if send_buffer is not None and send_buffer.sizes else None
        events = _MONITORED | (CONNECTION_EVENTS if self._send_buffer is not None else 0)
        self.monitor: zmq.Socket[Any] = sock.get_monitor_socket(
            events, f"inproc://inferd-monitor-{next(_monitors)}"
        )
        self.monitor.setsockopt(zmq.LINGER, 0)
        #: The monitor's descriptor: readable once news came after ``check`` last
        #: read all there was (a look at it costs ~1 us, ``ZMQ_EVENTS`` ~2.2 us).
        #: Not before the first such read: news written to a pipe whose reader
        #: never found it empty signals nothing.
        self._news = select.poll()
        self._news.register(int(self.monitor.get(zmq.FD)), select.POLLIN)
        self._read_once = False
        #: Connections to the daemon that ended once up: it stopped or restarted,
        #: or sent a frame over the socket's ``ZMQ_MAXMSGSIZE`` (indistinguishable).
        self.connections_lost = 0
        self._up = False
        #: The ZAP status code of the last handshake the daemon refused (400: its
        #: policy or ``bus.max_connections``; 500: its handler failed), None while
        #: none was or once a later handshake succeeded; the caller reads it after
        #: ``check`` (the request channel raises ``ConnectionRefused`` for the
        #: connection a call waits for, and makes the socket anew for one refused
        #: before; the events subscriber leaves it to its timeout).
        self.refused: int | None = None

    def check(self) -> int:
        """Read the monitor's news (all of it, until ``zmq.Again``: its descriptor
        is edge-triggered, and a look at it says whether anything came since);
        how many connections that were up it says ended.  With ``reconnect``,
        connects again when one ended and libzmq is not making it again: it does
        not after a protocol error, such as a frame over ``ZMQ_MAXMSGSIZE``.
        After a disconnection libzmq retries at once (``CONNECT_RETRIED``
        follows) where it will; when that news is not here yet, connecting again
        anew does no harm: ``disconnect`` ends libzmq's attempt, so there is
        still one connection."""
        monitor = self.monitor
        if self._read_once and not self._news.poll(0):
            return 0
        lost = 0
        again = False
        while True:
            try:
                news = parse_monitor_message(monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                self._read_once = True
                break
            event = int(news["event"])
            if event == _UP:
                self._up = True
                # libzmq's one more try of a refused connection was admitted: the
                # refusal is stale, and a live connection is not made anew for it.
                self.refused = None
            elif event == _DOWN:
                if self._up:  # a handshake that failed is left to libzmq
                    self._up = False
                    lost += 1
                    again = True
            elif event == _RETRYING:
                again = False
            elif event == _REFUSED:
                # libzmq tries such a connection once more, then never again: left
                # to the caller (the request channel raises ``ConnectionRefused``).
                self.refused = int(news["value"])
            elif self._send_buffer is not None and event & CONNECTION_EVENTS:
                self._send_buffer.size(int(news["value"]))
        self.connections_lost += lost
        if again and self._reconnect:
            with contextlib.suppress(zmq.ZMQError):  # no longer known to libzmq
                self._socket.disconnect(self._endpoint)
            connect(self._socket, self._endpoint)
        return lost

    def close(self) -> None:
        """Stop monitoring (before the socket closes)."""
        if not self._socket.closed:
            self._socket.disable_monitor()
        self.monitor.close(linger=0)
