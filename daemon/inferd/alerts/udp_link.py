"""Where a ``udp*:`` MAVLink hook sends, decided here rather than by pymavlink.

``udpout:host:port``: pymavlink resolved a host name on the alert's thread, in
every send.  ``UdpOut`` resolves it on a thread of its own
(``inferd-mavlink-resolve``): every 5 s until it resolves, then every
``REFRESH_INTERVAL_S`` and at once after a refused send (a station's address can
change), alerts going to the last address meanwhile.  No route to the address
(``NO_ROUTE_ERRNOS``; a zone id naming no interface) is no destination either (at
boot the radio's interface often comes up after the daemon): the link says
``unreachable``, the hook holds the alert, and the thread looks for the route
every ``NO_ROUTE_RETRY_S`` (a UDP ``connect``: no datagram), never sooner, and
tells the hook when it is back.  A zone id is passed as its interface's index,
looked up each time (Python ignores the ``%eth0`` of a 2-tuple).

``udpin:`` / ``udp:``: ``UdpPeers`` answers the ``MAX_UDP_PEERS`` heard from last
(pymavlink answered all, for good) and raises when it has nobody (DESIGN.md 168);
a thread of its own (``inferd-mavlink-peers``) reads the socket as datagrams
arrive.  Only whole MAVLink frames with a HEARTBEAT whose checksum is right teach
a peer (``mavlink_frames``).  With no route to any peer an alert is held as above;
the next heartbeat looks for the route and sends what is held.  A socket whose
address or interface is not there yet (``UdpSocket.bind_error``) is ``unbound``:
the thread tries to bind it every ``NO_ROUTE_RETRY_S``, then reads it.

``UdpSocket`` (``udp_socket``) opens the socket.  While a link has nowhere to
send, ``write`` raises ``NoDestinationError`` and the hook holds the alert;
``on_heard`` and ``on_resolved`` say when it has a destination.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from inferd.alerts.link_backlog import NoDestinationError
from inferd.alerts.mavlink_frames import has_heartbeat
from inferd.alerts.mavlink_frames import is_mavlink as is_mavlink
from inferd.alerts.udp_socket import NO_ROUTE_ERRNOS as NO_ROUTE_ERRNOS
from inferd.alerts.udp_socket import UdpSocket as UdpSocket
from inferd.alerts.udp_socket import no_route, sockaddr, why_missing
from inferd.config.mavlink_endpoint import split_host_port as split_host_port

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
#: Pause between looks for a missing route: how long after the route comes back
#: held alerts may wait when no alert comes first.  A look costs a route lookup.
NO_ROUTE_RETRY_S = 1.0
#: Ground stations answered at once (a GCS, a MAVLink router, a spare).
MAX_UDP_PEERS = 8
#: Datagrams read per alert to learn ground stations (heartbeats, 1 Hz each).
MAX_PEER_READS = 64
_READ_SIZE = 2048


def _probe_route(family: int, address: tuple[Any, ...]) -> None:
    """Raises what the kernel says of a route to ``address``: a UDP ``connect``
    looks it up and sends nothing (looked up at each call, as tests replace it).
    ``SO_BROADCAST`` as on the link's socket: a broadcast address is routed."""
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        probe.connect(address)


def _no_route_to(family: int, address: tuple[Any, ...]) -> OSError | None:
    """Why the kernel has no route to ``address`` (``_probe_route``), or None."""
    try:
        _probe_route(family, address)
    except OSError as exc:
        # connect says EINVAL for a link-local address on an interface that is
        # down, where sendto says EADDRNOTAVAIL; EACCES where it would refuse every
        # datagram to the address (a security module; a broadcast address without
        # SO_BROADCAST read ``up`` so); any other refusal is the send's
        if no_route(exc) or exc.errno in (errno.EINVAL, errno.EACCES):
            return exc
    return None


def _log_no_route(endpoint: str, error: str) -> None:
    log.warning(
        "mavlink_udp_no_route", endpoint=endpoint, error=error, retry_interval_s=NO_ROUTE_RETRY_S
    )


class UdpPeers:
    """``write`` (the encoder's, once per frame) sends to the newest peers heard
    on ``sock``; ``learn`` reads what they sent.  ``listen`` starts a thread
    that calls ``learn`` whenever something arrives, so nothing waits in the
    socket between alerts; ``close`` ends it and must come before ``sock`` is
    closed (its descriptor could be reused).  Thread-safe.  ``sock`` stays its
    opener's.  ``on_heard`` is called on the thread, with no lock of this class
    held, when it learns the first peer or one while ``no_route`` is set.  ``bind``,
    for a ``sock`` not bound yet (``UdpSocket.bind``): tried now, then by the
    thread every ``NO_ROUTE_RETRY_S`` until it returns None (bound)."""

    def __init__(
        self,
        sock: socket.socket,
        endpoint: str,
        *,
        on_heard: Callable[[], None] | None = None,
        bind: Callable[[], str | None] | None = None,
    ) -> None:
        self._sock = sock
        self._endpoint = endpoint
        self._on_heard = on_heard
        self._bind = bind
        #: Why ``sock`` is not bound yet (its address or interface is not there).
        self.unbound = bind() if bind is not None else None
        if self.unbound is not None:
            log.warning(
                "mavlink_udpin_not_bound",
                endpoint=endpoint,
                error=self.unbound,
                retry_interval_s=NO_ROUTE_RETRY_S,
            )
        #: Datagrams that teach no peer: not MAVLink frames, or no HEARTBEAT in them.
        self.ignored = 0
        #: Why the last send reached no peer (no route); None once one did or is routed.
        self.no_route: str | None = None
        #: ``mavlink_udp_no_route`` said for this outage: until a send gets through.
        self._outage_logged = False
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
        heartbeats; whether one was heard: the first, or one while ``no_route``."""
        if self.unbound is not None:  # nothing can have come
            return False
        with self._reading:
            with self._lock:
                had_peers, heard = bool(self._peers), False
            for _ in range(MAX_PEER_READS):
                try:
                    data, address = self._sock.recvfrom(_READ_SIZE)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # an ICMP error left by an earlier send: read on
                    continue
                learned = has_heartbeat(data)  # not a port scan, another protocol, junk
                with self._lock:
                    if not learned:
                        self.ignored += 1
                        continue
                    heard = True
                    self._peers.pop(address, None)
                    self._peers[address] = None
                    while len(self._peers) > MAX_UDP_PEERS:
                        del self._peers[next(iter(self._peers))]
            peers, lost = self.addresses, self.no_route
            # Not only a send clears it: with no alert held none may come for hours.
            routed = (_no_route_to(self._sock.family, peer) is None for peer in peers)
            if heard and lost is not None and any(routed):
                with self._lock:  # unless a send found no route since
                    self.no_route = None if self.no_route is lost else self.no_route
            return heard and (not had_peers or lost is not None)

    def write(self, data: bytes) -> None:
        peers = self.addresses
        if not peers:
            why = self.unbound or "no ground station has sent anything to it yet: nobody to answer"
            raise NoDestinationError(f"{self._endpoint}: {why}")
        errors: list[OSError] = []
        for address in peers:
            try:
                self._sock.sendto(data, address)
            except OSError as exc:
                errors.append(exc)
        if len(errors) < len(peers):
            self.no_route, self._outage_logged = None, False
            return
        if not all(no_route(exc) for exc in errors):
            raise errors[-1]
        if not self._outage_logged:  # once per outage: a route seen back is not its end
            _log_no_route(self._endpoint, repr(errors[-1]))
            self._outage_logged = True
        with self._lock:  # ``learn`` clears it under the lock
            self.no_route = repr(errors[-1])
        raise NoDestinationError(
            f"{self._endpoint}: no route to any ground station heard ({self.no_route})"
        )

    def _listen(self, wake: socket.socket) -> None:
        poller = select.poll()  # not select(): the daemon's descriptors may pass 1024
        poller.register(wake, select.POLLIN)
        said = {self.unbound}  # each reason logged once while unbound: no log per retry
        try:
            while self.unbound is not None and self._bind is not None:
                poller.poll(NO_ROUTE_RETRY_S * 1000)  # woken by ``close``
                if self._closed.is_set():
                    return
                try:
                    unbound = self._bind()
                except OSError as exc:  # the port taken meanwhile: said, and tried again
                    unbound = f"cannot bind it: {exc!r}"
                if unbound is None:
                    log.info("mavlink_udpin_bound", endpoint=self._endpoint, after=self.unbound)
                elif unbound not in said:  # EADDRINUSE after ENODEV: not in the log before
                    said.add(unbound)
                    log.warning(
                        "mavlink_udpin_bind_error_changed",
                        endpoint=self._endpoint,
                        error=unbound,
                        previous=self.unbound,
                        retry_interval_s=NO_ROUTE_RETRY_S,
                    )
                self.unbound = unbound
            poller.register(self._sock, select.POLLIN)
            while not self._closed.is_set():
                events = dict(poller.poll())
                if self._closed.is_set() or self._sock.fileno() < 0:
                    return
                if events.get(self._sock.fileno(), 0) & select.POLLNVAL:
                    return  # closed under it: a bug, but never a busy loop
                if self._sock.fileno() in events and self.learn() and self._on_heard:
                    self._on_heard()  # sends what is held: the outage ended unless it met none
                    self._outage_logged &= self.no_route is not None
        except Exception:  # never seen; the hook still learns before each alert
            log.exception("mavlink_udpin_reader_failed", endpoint=self._endpoint)


class UdpOut:
    """``write`` sends to ``host:port`` on ``sock`` (pymavlink's, closed with it),
    or raises ``OSError``: ``NoDestinationError`` while the name is not resolved
    or there is no route to its address, the kernel's error when it refuses the
    datagram (the name is then resolved again, never on the caller's thread).
    ``resolve``: the name's IPv4 address (``socket.gethostbyname``); an IP
    address (IPv6 too) is not resolved.  ``on_resolved`` is called on the link's
    thread when it gets a destination: the name resolves, the route comes back."""

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
        #: Set to end the thread's pause: by a refused send, by ``close``.
        self._wake = threading.Event()
        #: A refused send asked for the name to be resolved again.
        self._asked = False
        self._last_error = "not tried yet"
        #: Why the last send or look found no route to the address; None while one did.
        self._no_route: str | None = None
        #: ``mavlink_udp_no_route`` said for this outage: until a send gets through.
        self._outage_logged = False
        self._address: tuple[Any, ...] | None = None
        self._starting = threading.Lock()
        self._thread: threading.Thread | None = None
        try:
            ipaddress.ip_address(host)
        except ValueError:  # a name, resolved to IPv4: the socket is IPv4
            self._name = True
            self._start_thread()
            return
        self._name = False
        if not self._look():  # no route yet (at boot): said now, looked for on the thread
            self._ask()

    def write(self, data: bytes) -> None:
        address = self._address
        if address is None:
            why = self._no_route or f"{self._host!r} is not resolved yet ({self._last_error})"
            raise NoDestinationError(f"{self._endpoint}: {why}")
        try:
            self._sock.sendto(data, address)
        except BlockingIOError:  # a full send buffer: nothing to say about the address
            raise
        except OSError as exc:  # unreachable, refused: the station may have moved, ask again now
            if no_route(exc):
                self._lost(repr(exc))
                self._ask()
                raise NoDestinationError(f"{self._endpoint}: no route yet ({exc!r})") from exc
            if self._name:
                self._ask()
            raise
        self._no_route, self._outage_logged = None, False

    @property
    def state(self) -> tuple[str, str | None]:
        """``up``, ``unresolved`` (the name) or ``unreachable`` (no route to its
        address), and why it is not up."""
        no_route = self._no_route
        if no_route is not None:
            return "unreachable", no_route
        if self._address is None:
            return "unresolved", self._last_error
        return "up", None

    def close(self) -> None:
        """Ends the link's thread at once, or after its try (a resolver's is left to it)."""
        self._closed.set()
        self._wake.set()

    def _ask(self) -> None:
        """Wake the thread (started now if need be): resolve the name, look for the route."""
        self._asked = True
        self._wake.set()
        with contextlib.suppress(RuntimeError):  # no thread: the next alert tries
            self._start_thread()

    def _start_thread(self) -> None:
        with self._starting:
            if self._thread is None and not self._closed.is_set():
                thread = threading.Thread(target=self._run, name=RESOLVE_THREAD_NAME, daemon=True)
                thread.start()
                self._thread = thread

    def _lost(self, error: str) -> None:
        if not self._outage_logged:  # once per outage: a route seen back is not its end
            _log_no_route(self._endpoint, error)
            self._outage_logged = True
        self._no_route = error

    def _look(self) -> bool:
        """Whether there is a route to the address now (an address's zone id looked
        up again: an interface made again has a new index); records why not."""
        try:
            if not self._name:  # sent to even with no route seen: the send may find one
                self._address = sockaddr(self._host, self._port)
        except socket.gaierror as exc:
            self._lost(why_missing(self._host, exc))
            return False
        if self._address is None:
            return False
        if (missing := _no_route_to(self._sock.family, self._address)) is not None:
            self._lost(repr(missing))
            return False
        self._no_route = None
        return True

    def _run(self) -> None:
        """Resolve the name: again every ``RETRY_INTERVAL_S`` while it fails, every
        ``refresh_interval_s`` once it resolved, and at once after a refused send
        (one asked for during a try makes one more after it).  While there is no
        route, look for it every ``NO_ROUTE_RETRY_S``; never sooner after a try,
        even when asked.  Call ``on_resolved`` when the link gets a destination."""
        resolve_at = 0.0
        while True:
            self._wake.clear()  # before the look at ``_closed``: a close after it wakes
            if self._closed.is_set():
                return
            had, tried_at = self.state[0] == "up", time.monotonic()
            if self._name and (self._asked or time.monotonic() >= resolve_at):
                self._asked = False
                resolve_at = time.monotonic() + self._resolve()
                if self._address is not None:
                    self._look()
            elif self._no_route is not None:
                self._look()
            if not had and self.state[0] == "up" and self._on_resolved is not None:
                self._on_resolved()  # sends what is held: the outage ended unless it met none
                self._outage_logged &= self._no_route is not None
            pause = max(0.0, resolve_at - time.monotonic()) if self._name else None
            if self._no_route is not None:
                pause = min(pause, NO_ROUTE_RETRY_S) if pause is not None else NO_ROUTE_RETRY_S
            self._wake.wait(pause)
            # Woken by a refused send: a look finding a route sends find not would spin.
            self._closed.wait(max(0.0, tried_at + NO_ROUTE_RETRY_S - time.monotonic()))

    def _resolve(self) -> float:
        """Resolve the name once; returns the pause before the next time."""
        try:
            ip = self._lookup(self._host)
        except Exception as exc:  # OSError (gaierror), UnicodeError
            self._last_error = repr(exc)  # alerts go where it last resolved to
            return RETRY_INTERVAL_S
        previous, self._address = self._address, (ip, self._port)
        if previous is not None and previous[0] != ip:
            log.info(
                "mavlink_udpout_readdressed",
                endpoint=self._endpoint,
                address=ip,
                previous=previous[0],
            )
        return self._refresh_interval_s


def _gethostbyname(host: str) -> str:
    return socket.gethostbyname(host)  # looked up at each call, as tests replace it
