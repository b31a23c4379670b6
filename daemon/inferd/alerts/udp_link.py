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
so a station back on a new port was not answered.  Only a datagram made of
whole MAVLink frames (``is_mavlink``) teaches a peer: any sender did before,
and 8 junk datagrams from 8 ports pushed the real station out.

The socket is opened here too (``UdpSocket``), not by pymavlink, whose
``mavudp`` is IPv4 only: ``[::1]:14550`` and ``[::]:14550`` get an IPv6 socket.
While a link has nowhere to send, ``write`` raises ``NoDestinationError`` and
the hook holds the alert; ``on_heard`` (the first peer) and ``on_resolved``
(the name) tell it when to send what it holds (``link_backlog``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

import structlog

from inferd.alerts.link_backlog import NoDestinationError

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
_V1_MAGIC, _V2_MAGIC = 0xFE, 0xFD
#: MAVLink 2's incompat flag for a signed frame, which carries 13 more bytes.
_V2_SIGNED = 0x01


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` as ``(host, port)``, brackets stripped;
    ``ValueError`` for anything else (the config refuses those first)."""
    host, _, port = address.rpartition(":")
    bare = host.removeprefix("[").removesuffix("]")
    if host == f"[{bare}]":
        ipaddress.IPv6Address(bare)  # only an IPv6 address goes in brackets
    elif any(char in host for char in ":[]"):
        raise ValueError(f"{address!r}: an IPv6 address goes in brackets, as [::1]:14550")
    if not bare or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return bare, int(port)


class UdpSocket:
    """The socket of a ``udpin:``/``udp:`` (bound to the endpoint) or
    ``udpout:`` endpoint: non-blocking, IPv6 for a bracketed address.  ``port``
    is the socket, as pymavlink's ``mavudp`` names it."""

    def __init__(self, endpoint: str) -> None:
        kind, _, address = endpoint.partition(":")
        if kind not in ("udpin", "udp", "udpout"):
            raise ValueError(f"{endpoint!r} is not a udpin:, udp: or udpout: endpoint")
        self.host, port = split_host_port(address)
        self.udp_server = kind != "udpout"
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self.port = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.port.setblocking(False)
            if self.udp_server:  # as pymavlink did: a restarted daemon binds again at once
                self.port.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self.port.bind((self.host, port))
        except BaseException:
            self.port.close()
            raise
        self.destination_addr: tuple[str, int] | None = (
            None if self.udp_server else (self.host, port)
        )

    def close(self) -> None:
        self.port.close()


def is_mavlink(data: bytes) -> bool:
    """Whether ``data`` is one or more whole MAVLink frames, back to back: each
    starts with v1's or v2's magic byte and the lengths in their headers end
    exactly where the datagram does."""
    offset = 0
    while offset < len(data):
        left, magic = len(data) - offset, data[offset]
        if magic == _V2_MAGIC and left >= 12:
            signed = data[offset + 2] & _V2_SIGNED
            offset += 12 + data[offset + 1] + (13 if signed else 0)
        elif magic == _V1_MAGIC and left >= 8:
            offset += 8 + data[offset + 1]
        else:
            return False
    return offset == len(data) > 0


class UdpPeers:
    """``write`` (the encoder's, once per frame) sends to the newest peers heard
    on ``sock``; ``learn`` reads what they sent.  ``listen`` starts a thread
    that calls ``learn`` whenever something arrives, so nothing waits in the
    socket between alerts; ``close`` ends it and must come before ``sock`` is
    closed (its descriptor could be reused).  Thread-safe.  ``sock`` stays
    its opener's, closed by it.  ``on_heard`` is called on the thread when it
    learns the first peer, never with a lock of this class held."""

    def __init__(
        self,
        sock: socket.socket,
        endpoint: str,
        *,
        on_heard: Callable[[], None] | None = None,
    ) -> None:
        self._sock = sock
        self._endpoint = endpoint
        self._on_heard = on_heard
        #: Datagrams not made of MAVLink frames, which teach no peer.
        self.ignored = 0
        self._lock = threading.Lock()
        #: One reader at a time (the thread, an alert): peers go in in the order read.
        self._reading = threading.Lock()
        #: Insertion order is the order heard: the newest last.
        self._peers: dict[tuple[Any, ...], None] = {}
        self._closed = threading.Event()
        self._listener: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None

    @property
    def addresses(self) -> tuple[tuple[Any, ...], ...]:
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

    def learn(self) -> bool:
        """Read up to ``MAX_PEER_READS`` pending datagrams, learning who sent the
        MAVLink ones; returns whether the first peer was learned."""
        with self._reading:
            with self._lock:
                had_peers = bool(self._peers)
            for _ in range(MAX_PEER_READS):
                try:
                    data, address = self._sock.recvfrom(_READ_SIZE)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # an ICMP error left by an earlier send: read on
                    continue
                with self._lock:
                    if not is_mavlink(data):  # a port scan, another protocol: no station
                        self.ignored += 1
                        continue
                    self._peers.pop(address, None)
                    self._peers[address] = None
                    while len(self._peers) > MAX_UDP_PEERS:
                        del self._peers[next(iter(self._peers))]
            with self._lock:
                return not had_peers and bool(self._peers)

    def write(self, data: bytes) -> None:
        peers = self.addresses
        if not peers:
            raise NoDestinationError(
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
                if self._sock.fileno() in events and self.learn() and self._on_heard:
                    self._on_heard()
        except Exception:  # never seen; the hook still learns before each alert
            log.exception("mavlink_udpin_reader_failed", endpoint=self._endpoint)


class UdpOut:
    """``write`` sends to ``host:port`` on ``sock`` (pymavlink's, closed with it),
    or raises ``OSError``: while the host name is not resolved yet, or when the
    kernel refuses the datagram (which asks for the name to be resolved again).
    Never resolves a name on the caller's thread.  ``resolve``: the name's IPv4
    address (``socket.gethostbyname``, looked up at each call); an IP address
    (IPv6 too, on an IPv6 ``sock``) is not resolved.  ``on_resolved`` is called
    on the resolving thread when the name first resolves."""

    def __init__(
        self,
        sock: socket.socket,
        host: str,
        port: int,
        endpoint: str,
        *,
        resolve: Callable[[str], str] | None = None,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        on_resolved: Callable[[], None] | None = None,
    ) -> None:
        self._sock = sock
        self._on_resolved = on_resolved
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
            self._address = (str(ipaddress.ip_address(host)), port)
        except ValueError:  # a name, resolved to IPv4: the socket is IPv4
            self._resolver = threading.Thread(
                target=self._resolve, name=RESOLVE_THREAD_NAME, daemon=True
            )
            self._resolver.start()

    def write(self, data: bytes) -> None:
        address = self._address
        if address is None:
            raise NoDestinationError(
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

    @property
    def resolved(self) -> bool:
        return self._address is not None

    @property
    def last_error(self) -> str | None:
        """Why the name does not resolve; None once it did."""
        return None if self._address is not None else self._last_error

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
                if previous is None and self._on_resolved is not None:
                    self._on_resolved()
                elif previous is not None and previous[0] != ip:
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
