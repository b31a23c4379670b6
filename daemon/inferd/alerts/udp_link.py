"""Where a ``udp*:`` MAVLink hook sends, decided here rather than by pymavlink.

``udpout:host:port``: pymavlink's ``mavudp.write`` resolves a host name with
``socket.gethostbyname`` in the first send, on the thread that raised the alert,
swallows the failure, and then hands the name to ``sendto``, which resolves it
again in every send: with no route to a DNS server (the ground link down) each
alert waited out the resolver and counted as sent.  ``UdpOut`` resolves the name
on a thread of its own (``inferd-mavlink-resolve``: again every 5 s until it
resolves) and raises until then; a send the kernel refuses raises too.  A ground
station's address can change (DHCP, a spare station taking over its name), so
the thread resolves the name again every ``REFRESH_INTERVAL_S`` and at once
after a send the kernel refused; meanwhile alerts go to the last address it
resolved to.  The thread raising an alert never waits for any of it.

``udpin:`` / ``udp:``: on such an endpoint pymavlink's ``mavudp`` answers every
address it ever heard a datagram from (``clients``, never forgotten with
``udp_timeout`` 0): each ground-station restart on a new port, and anyone who
can reach the port, adds one for good, and every alert is sent to all of them on
the thread that raised it.  Before it heard anyone it sends to nobody and says
nothing, so the dispatcher counted those alerts sent.  ``UdpPeers`` is the
hook's encoder file instead: it remembers the ``MAX_UDP_PEERS`` addresses heard
from last and raises ``ConnectionError`` when it has nobody to send to
(DESIGN.md 168).  It reads the socket on a thread of its own
(``inferd-mavlink-peers``, started by ``listen``) as datagrams arrive: read only
when an alert was raised, a station's heartbeats piled up between alerts (the
oldest read first, the newest dropped by the kernel once the buffer was full),
so a station back on a new port was not answered.
"""

from __future__ import annotations

import contextlib
import ipaddress
import select
import socket
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger("inferd.alerts.mavlink")

RESOLVE_THREAD_NAME = "inferd-mavlink-resolve"
PEERS_THREAD_NAME = "inferd-mavlink-peers"
#: Longest wait for the reading thread to end in ``UdpPeers.close`` (it is woken).
PEERS_JOIN_S = 1.0
#: Pause between tries while the ground station's name does not resolve.
RETRY_INTERVAL_S = 5.0
#: Pause before resolving a name again once it resolved: how long a ground
#: station whose address changed may go without alerts when no send is refused.
REFRESH_INTERVAL_S = 60.0
#: Ground stations answered at once (a GCS, a MAVLink router, a spare).
MAX_UDP_PEERS = 8
#: Datagrams read per alert to learn ground stations (heartbeats, 1 Hz each).
MAX_PEER_READS = 64
_READ_SIZE = 2048


class UdpPeers:
    """``write`` (the encoder's, once per frame) sends to the newest peers heard
    on ``sock``; ``learn`` reads what they sent.  ``listen`` starts a thread
    that calls ``learn`` whenever something arrives, so nothing waits in the
    socket between alerts; ``close`` ends it and must come before ``sock`` is
    closed (its descriptor could be reused).  Thread-safe.  ``sock`` stays
    pymavlink's, closed with it."""

    def __init__(self, sock: socket.socket, endpoint: str) -> None:
        self._sock = sock
        self._endpoint = endpoint
        self._lock = threading.Lock()
        #: One reader at a time (the thread, an alert): peers go in in the order read.
        self._reading = threading.Lock()
        #: Insertion order is the order heard: the newest last.
        self._peers: dict[tuple[str, int], None] = {}
        self._closed = threading.Event()
        self._listener: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        with self._lock:
            return tuple(self._peers)

    def listen(self) -> None:
        """Start reading in the background; raises if the thread cannot start."""
        wake = socket.socketpair()
        listener = threading.Thread(
            target=self._listen, args=(wake[0],), name=PEERS_THREAD_NAME, daemon=True
        )
        self._wake, self._listener = wake, listener
        try:
            listener.start()
        except BaseException:
            self._wake = self._listener = None
            for end in wake:
                end.close()
            raise

    def close(self) -> None:
        """End the reading thread (at once: it is woken), before ``sock`` closes."""
        self._closed.set()
        if self._wake is None or self._listener is None:
            return
        with contextlib.suppress(OSError):  # the pair's buffer is full: it is awake anyway
            self._wake[1].send(b"\0")
        self._listener.join(PEERS_JOIN_S)
        if self._listener.is_alive():  # never seen (it only polls and reads): keep the
            return  # wake socket open, so no descriptor it polls is reused under it
        for end in self._wake:
            end.close()

    def learn(self) -> None:
        """Read up to ``MAX_PEER_READS`` pending datagrams, learning who sent them."""
        with self._reading:
            for _ in range(MAX_PEER_READS):
                try:
                    _data, address = self._sock.recvfrom(_READ_SIZE)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:  # an ICMP error left by an earlier send: read on
                    continue
                with self._lock:
                    self._peers.pop(address, None)
                    self._peers[address] = None
                    while len(self._peers) > MAX_UDP_PEERS:
                        del self._peers[next(iter(self._peers))]

    def write(self, data: bytes) -> None:
        peers = self.addresses
        if not peers:
            raise ConnectionError(
                f"no ground station has sent anything to {self._endpoint} yet: nobody to answer"
            )
        error: OSError | None = None
        sent = False
        for address in peers:
            try:
                self._sock.sendto(data, address)
                sent = True
            except OSError as exc:
                error = exc
        if not sent and error is not None:
            raise error

    def _listen(self, wake: socket.socket) -> None:
        poller = select.poll()  # not select(): the daemon's descriptors may pass 1024
        poller.register(self._sock, select.POLLIN)
        poller.register(wake, select.POLLIN)
        try:
            while not self._closed.is_set():
                events = dict(poller.poll())
                if self._closed.is_set() or self._sock.fileno() < 0:
                    return
                if events.get(self._sock.fileno(), 0) & select.POLLNVAL:
                    return  # closed under it: a bug, but never a busy loop
                if self._sock.fileno() in events:
                    self.learn()
        except Exception:  # never seen; the hook still learns before each alert
            log.exception("mavlink_udpin_reader_failed", endpoint=self._endpoint)


class UdpOut:
    """``write`` sends to ``host:port`` on ``sock`` (pymavlink's, closed with it),
    or raises ``OSError``: while the host name is not resolved yet, or when the
    kernel refuses the datagram (which asks for the name to be resolved again).
    Never resolves a name on the caller's thread.  ``resolve``: the name's IPv4
    address (``socket.gethostbyname``, looked up at each call)."""

    def __init__(
        self,
        sock: socket.socket,
        host: str,
        port: int,
        endpoint: str,
        *,
        resolve: Callable[[str], str] | None = None,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
    ) -> None:
        self._sock = sock
        self._host = host
        self._port = port
        self._endpoint = endpoint
        self._lookup = resolve if resolve is not None else _gethostbyname
        self._refresh_interval_s = refresh_interval_s
        self._closed = threading.Event()
        #: Set to end the resolving thread's pause: by a refused send, by ``close``.
        self._wake = threading.Event()
        self._last_error = "not tried yet"
        self._address: tuple[str, int] | None = None
        self._resolver: threading.Thread | None = None
        try:
            self._address = (str(ipaddress.IPv4Address(host)), port)
        except ValueError:  # a name: pymavlink's socket is IPv4
            self._resolver = threading.Thread(
                target=self._resolve, name=RESOLVE_THREAD_NAME, daemon=True
            )
            self._resolver.start()

    def write(self, data: bytes) -> None:
        address = self._address
        if address is None:
            raise ConnectionError(
                f"{self._endpoint}: {self._host!r} is not resolved yet ({self._last_error})"
            )
        try:
            self._sock.sendto(data, address)
        except BlockingIOError:  # a full send buffer: nothing to say about the address
            raise
        except OSError:  # unreachable, refused: the station may have moved, ask again now
            if self._resolver is not None:
                self._wake.set()
            raise

    def close(self) -> None:
        """Ends the resolving thread at once, or after the try it is in; one that
        waits on the resolver is left to it (a daemon thread holding no socket)."""
        self._closed.set()
        self._wake.set()

    def _resolve(self) -> None:
        """Resolve the name: again every ``RETRY_INTERVAL_S`` while it fails, every
        ``refresh_interval_s`` once it resolved, and at once after a refused send
        (one asked for during a try makes one more after it)."""
        while True:
            self._wake.clear()  # before the look at ``_closed``: a close after it wakes
            if self._closed.is_set():
                return
            try:
                ip = self._lookup(self._host)
            except Exception as exc:  # OSError (gaierror), UnicodeError
                self._last_error = repr(exc)  # alerts go where it last resolved to
                pause = RETRY_INTERVAL_S
            else:
                previous, self._address = self._address, (ip, self._port)
                if previous is not None and previous[0] != ip:
                    log.info(
                        "mavlink_udpout_readdressed",
                        endpoint=self._endpoint,
                        address=ip,
                        previous=previous[0],
                    )
                pause = self._refresh_interval_s
            self._wake.wait(pause)


def _gethostbyname(host: str) -> str:
    return socket.gethostbyname(host)  # looked up at each call, as tests replace it
