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
libzmq does not connect such a socket again (libzmq 4.3.5, a SUB and a DEALER:
one ZAP request, none more in 2.5 s), so a caller that waited for it would wait
out its whole timeout; ``refuse`` raises ``ConnectionRefused`` for it, the one
way of the request channel and the event subscriber (DESIGN.md 322, 325).

libzmq allows one monitor per socket, so a socket whose ``ipc://`` connections
``SendBuffer`` sizes shares this one: the watch also asks for its events
(``CONNECTED``, ``ACCEPTED``) and hands each descriptor to ``SendBuffer.size``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import select
from typing import Any, NoReturn

import zmq
from zmq.utils.monitor import parse_monitor_message

from inferd_client.endpoint_trust import connect
from inferd_client.errors import ConnectionRefused, Unreachable
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


def socket_error(endpoint: str, exc: zmq.ZMQError) -> Unreachable:
    """A socket for ``endpoint``, or its monitor, that ZeroMQ could not make
    (``EMFILE`` at the descriptor limit, a terminated context): ``Unreachable``
    naming the endpoint and the errno, as ``RegionChannel`` says of its own
    (DESIGN.md 302), not a bare ``zmq.ZMQError`` out of a client."""
    code = exc.errno if exc.errno is not None else 0
    name = errno.errorcode.get(code, f"errno {code}")
    return Unreachable(f"cannot make a socket for {endpoint}: {name}: {exc.strerror}")


def make_socket(context: zmq.Context[Any], kind: int, endpoint: str) -> zmq.Socket[Any]:
    """``context.socket(kind)``, for ``endpoint``; ``socket_error`` when it cannot be made."""
    try:
        sock: zmq.Socket[Any] = context.socket(kind)
    except zmq.ZMQError as exc:
        raise socket_error(endpoint, exc) from None
    return sock


def refused_error(endpoint: str, status: int, anew: str) -> ConnectionRefused:
    """The ``ConnectionRefused`` for a connection to ``endpoint`` the daemon refused at
    its handshake with ZAP ``status``; ``anew`` says what connects again (the next
    call, the next receive).  The handshake carries the status alone: the daemon's
    reason (its ZAP reply's status text) is only in its log."""
    return ConnectionRefused(
        f"the daemon at {endpoint} refused this client's connection at its "
        f"handshake (ZAP status {status}): its access policy does not admit this "
        "client, or this peer (a local user, a remote host) already holds "
        "bus.max_connections connections to that socket; the daemon's log says why "
        "(peer_refused), status counts it (security.sockets.<socket>."
        f"connections_refused); {anew}",
        status,
    )


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
        try:
            self.monitor: zmq.Socket[Any] = sock.get_monitor_socket(
                events, f"inproc://inferd-monitor-{next(_monitors)}"
            )
        except zmq.ZMQError as exc:  # the caller closes ``sock``, its monitoring with it
            raise socket_error(endpoint, exc) from None
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
        #: before; the events subscriber raises it from the receive that reads it,
        #: ``refuse``, but forgets one read before its first receive and connects anew).
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
                # libzmq never connects such a socket again: left to the caller
                # (``refuse``; the request channel makes its socket anew).
                self.refused = int(news["value"])
            elif self._send_buffer is not None and event & CONNECTION_EVENTS:
                self._send_buffer.size(int(news["value"]))
        self.connections_lost += lost
        if again and self._reconnect:
            self.connect_anew()
        return lost

    def connect_anew(self) -> None:
        """Connect the socket to the endpoint again: ``disconnect`` first ends any
        attempt libzmq still makes, so there is one connection at most."""
        with contextlib.suppress(zmq.ZMQError):  # no longer known to libzmq
            self._socket.disconnect(self._endpoint)
        connect(self._socket, self._endpoint)

    def refuse(self, anew: str) -> NoReturn:
        """Raise ``ConnectionRefused`` for the refusal ``check`` read (``refused``, then
        forgotten), the socket disconnected first: no try of libzmq's goes on while
        the caller makes room, and the caller connects again (``connect_anew``) when
        it next waits.  ``anew`` is for ``refused_error``."""
        status = self.refused
        assert status is not None, "refuse() without a refusal read"
        self.refused = None
        with contextlib.suppress(zmq.ZMQError):  # no longer known to libzmq
            self._socket.disconnect(self._endpoint)
        raise refused_error(self._endpoint, status, anew)

    def close(self) -> None:
        """Stop monitoring (before the socket closes)."""
        if not self._socket.closed:
            self._socket.disable_monitor()
        self.monitor.close(linger=0)
