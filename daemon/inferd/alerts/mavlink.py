"""Alerts as MAVLink STATUSTEXT, the way QGroundControl and Mission Planner show them.

Text: ``"<code>: <message>"`` (plus ``" (+N repeats)"`` when the dispatcher
held repeats back), one line of printable ASCII.  STATUSTEXT's ``text`` is a
``char[50]``; receivers decode it chunk by chunk (pymavlink as ASCII, QGC
counts characters to find the last chunk), so a multi-byte UTF-8 character
could be split or end a sequence early: non-ASCII characters are transliterated
where Unicode allows (``é`` -> ``e``) and become ``?`` otherwise.  The full
text still goes to the PUB socket and the FDR.

MAVLink 2: a text of up to 50 characters is one message with ``id = 0``; a
longer one is split into 50-character chunks that share a non-zero ``id`` and
count ``chunk_seq`` up from 0.  Receivers (QGC, MAVSDK, PX4) take a chunk
without a NUL as "more to come", so the last chunk must be shorter than 50:
a text whose length is a multiple of 50 gets one trailing space.  At most
``max_chunks`` chunks are sent (telemetry radios are slow); longer texts are
cut and end in ``...``.  MAVLink 1 has no chunking: the text is cut to 50.
Only as much of a text as the budget takes is transliterated: a 1 MB message
cost the raising thread over 100 ms when the whole of it was.

An alert the link had nowhere to send (no ground station heard yet, not
connected, the name not resolved, no route to the address) is a failure, and is
also held: when the link finds a destination it is sent, ending
``" (N s late)"`` (``link_backlog``).  While any is held, a new alert goes behind
them: held alerts always go out first.  ``status()`` says whether the link has
a destination now.

pymavlink is imported when a hook is built, never at module import, so the
daemon runs without it unless the ``mavlink`` hook is configured.
"""

from __future__ import annotations

import threading
import time
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from inferd.alerts.hooks import SUPPRESSED_FIELD
from inferd.alerts.interface import AlertHookUnavailableError
from inferd.alerts.levels import mav_severity
from inferd.alerts.link_backlog import LinkBacklog, NoDestinationError
from inferd.alerts.tcp_link import TcpLink
from inferd.alerts.udp_link import UdpOut, UdpPeers, UdpSocket, split_host_port
from inferd.types import AlertLevel

log = structlog.get_logger("inferd.alerts.mavlink")

#: Length of STATUSTEXT's ``text`` field (``char[50]``).
STATUSTEXT_LEN = 50
#: Default chunk budget: 199 characters, four messages.
DEFAULT_MAX_CHUNKS = 4
#: ``chunk_seq`` is a uint8.
MAX_CHUNKS_LIMIT = 256
_ELLIPSIS = "..."
_TCP_PREFIX = "tcp:"
#: The endpoints whose socket the hook opens itself (``UdpSocket``), IPv6 included.
_UDP_KINDS = ("udpin", "udp", "udpout")


def statustext_chunks(
    text: str, *, suffix: str = "", max_chunks: int = DEFAULT_MAX_CHUNKS
) -> list[bytes]:
    """The ``text`` fields for ``text + suffix``, in ``chunk_seq`` order.

    One element means "send with ``id = 0``".  When the budget is exceeded
    ``text`` is cut and ends in ``...``; ``suffix`` (the repeat count) is kept.
    ``max_chunks = 1`` is the MAVLink 1 behaviour: at most 50 characters.
    """
    if not 1 <= max_chunks <= MAX_CHUNKS_LIMIT:
        raise ValueError(f"max_chunks must be 1..{MAX_CHUNKS_LIMIT}, got {max_chunks}")
    limit = _text_limit(max_chunks)
    body = _printable_prefix(text, limit).encode("ascii")
    tail = _printable_ascii(suffix).encode("ascii")
    data = body + tail
    if len(data) <= STATUSTEXT_LEN:
        return [data]
    if len(data) > limit:
        keep = max(limit - len(tail) - len(_ELLIPSIS), 0)
        data = (body[:keep].rstrip() + _ELLIPSIS.encode() + tail)[:limit]
    if len(data) <= STATUSTEXT_LEN:
        return [data]
    if len(data) % STATUSTEXT_LEN == 0:
        data += b" "
    return [data[start : start + STATUSTEXT_LEN] for start in range(0, len(data), STATUSTEXT_LEN)]


def _text_limit(max_chunks: int) -> int:
    """Characters ``max_chunks`` carry: a chunked text must end in a chunk
    shorter than 50 (it carries the NUL)."""
    return STATUSTEXT_LEN if max_chunks == 1 else STATUSTEXT_LEN * max_chunks - 1


def _printable_prefix(text: str, limit: int) -> str:
    """``_printable_ascii(text)`` cut to ``limit + 1`` characters (the one more
    says the text is longer), transliterating only as much of ``text`` as that
    takes, a slice at a time.  The same as transliterating all of it, then
    cutting: each character's result does not depend on its neighbours (NFKD
    only decomposes, and the combining marks its reordering moves are dropped),
    so a slice's result is a prefix of the whole one, cut anywhere."""
    out = ""
    step = limit + 1
    for start in range(0, len(text), step):
        out += _printable_ascii(text[start : start + step])
        if len(out) > limit:  # marks alone (zero characters each) read on
            return out[:step]
    return out


def repeats_suffix(suppressed: int) -> str:
    """What a STATUSTEXT says about repeats held back before it."""
    return f" (+{suppressed} repeats)" if suppressed > 0 else ""


def _printable_ascii(text: str) -> str:
    out: list[str] = []
    for char in unicodedata.normalize("NFKD", text):
        if unicodedata.combining(char):
            continue
        if char in "\t\r\n":
            out.append(" ")
        elif " " <= char <= "~":
            out.append(char)
        else:
            out.append("?")
    return "".join(out)


class MavlinkAlertHook:
    """Sends each alert as STATUSTEXT with the level's ``MAV_SEVERITY``.

    ``endpoint`` is a pymavlink connection string; ``udpout:host:port`` is the
    usual one (the ground station or a MAVLink router listens there; a host
    name is resolved on a thread of its own, ``UdpOut``, and a send the kernel
    refuses raises).  On a
    ``udpin:`` (``udp:``) endpoint the hook answers the peers it heard from last
    (``UdpPeers``), reading its socket on a thread of its own as datagrams arrive
    (and once more before each send) to learn them; an alert with nobody to
    answer fails.  Its address or interface not there yet (a zone id naming no
    interface), the hook opens all the same, ``unreachable``, and binds once it
    is there (``UdpSocket.bind``, tried every second).  A ``tcp:``
    endpoint is a ``TcpLink``: connected in the background (the daemon never
    waits for its ground station) and every frame it cannot send raises, so
    the dispatcher counts the alert as a failure rather than as sent.  A host
    may be an IPv6 address in brackets (``udpout:[::1]:14550``).  An alert that
    failed for want of a destination is held and sent late (``LinkBacklog``;
    ``clock`` says how late).

    Ground stations file STATUSTEXT under the vehicle with the same system
    id, so ``source_system`` should be the autopilot's; ``source_component``
    defaults to ``MAV_COMP_ID_ONBOARD_COMPUTER`` (191), and is never 0
    (``MAV_COMP_ID_ALL``: a broadcast target, not a valid sender).

    Raises ``AlertHookUnavailableError`` when pymavlink is missing or the
    endpoint cannot be opened, ``ValueError`` for ids or a chunk budget out of
    range.  Thread-safe; ``alert`` after ``close`` sends nothing and raises, so
    the dispatcher counts it as this hook's failure rather than as sent.
    """

    name = "mavlink"

    def __init__(
        self,
        endpoint: str,
        source_system: int = 1,
        source_component: int = 191,
        *,
        mavlink2: bool = True,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= source_system <= 255:
            raise ValueError(f"source_system must be 1..255, got {source_system}")
        if not 1 <= source_component <= 255:  # 0 is MAV_COMP_ID_ALL, a target only
            raise ValueError(f"source_component must be 1..255, got {source_component}")
        if not 1 <= max_chunks <= MAX_CHUNKS_LIMIT:
            raise ValueError(f"max_chunks must be 1..{MAX_CHUNKS_LIMIT}, got {max_chunks}")
        try:
            from pymavlink import mavutil

            if mavlink2:
                from pymavlink.dialects.v20 import common as dialect
            else:
                from pymavlink.dialects.v10 import common as dialect
        except ImportError as exc:
            raise AlertHookUnavailableError(
                self.name, f"pymavlink is not installed ({exc}); install inferd[mavlink]"
            ) from None
        self.endpoint = endpoint
        self.mavlink2 = mavlink2
        self.max_chunks = max_chunks if mavlink2 else 1
        # Before the links: their threads may call ``_link_up`` at once.
        self._lock = threading.Lock()
        self._closed = False
        self._last_id = 0
        self._backlog = LinkBacklog(clock=clock)
        #: Whom a ``udpin:`` endpoint answers; None for the other endpoints.
        self._peers: UdpPeers | None = None
        #: Where a ``udpout:`` endpoint sends; None for the other endpoints.
        self._out: UdpOut | None = None
        try:
            if endpoint.startswith(_TCP_PREFIX):
                connection: Any = _tcp_link(endpoint, self._link_up)
            elif endpoint.partition(":")[0] in _UDP_KINDS:  # pymavlink's mavudp is IPv4 only
                connection = UdpSocket(endpoint)
            else:  # not one the config allows (a serial port, udpbcast:)
                connection = mavutil.mavlink_connection(
                    endpoint, source_system=source_system, source_component=source_component
                )
        except Exception as exc:
            raise AlertHookUnavailableError(
                self.name, f"cannot open MAVLink endpoint {endpoint!r}: {exc}"
            ) from None
        self._connection = connection
        file: Any = connection
        try:
            if isinstance(connection, UdpSocket) and connection.udp_server:
                # An address or interface not there yet: bound later, alerts held meanwhile.
                bind = connection.bind if connection.bind_error is not None else None
                file = self._peers = UdpPeers(
                    connection.port, endpoint, on_heard=self._link_up, bind=bind
                )
                self._peers.listen()
            elif isinstance(connection, UdpSocket) and connection.destination_addr is not None:
                host, port = connection.destination_addr
                file = self._out = UdpOut(
                    connection.port, host, port, endpoint, on_resolved=self._link_up
                )
        except Exception as exc:  # the reading or resolving thread cannot start
            connection.close()
            raise AlertHookUnavailableError(self.name, f"{endpoint!r}: {exc}") from None
        # Our own encoder, so the wire version is what was asked for and not
        # what pymavlink's process-wide dialect (``MAVLINK20``) happens to be.
        self._mav: Any = dialect.MAVLink(
            file, srcSystem=source_system, srcComponent=source_component
        )

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        severity = mav_severity(level)
        suppressed = fields.get(SUPPRESSED_FIELD, 0)
        # What is held: the text as sent, long enough to be cut as the whole one.
        text = _printable_prefix(f"{code}: {message}", _text_limit(self.max_chunks))
        suffix = repeats_suffix(suppressed if isinstance(suppressed, int) else 0)
        chunks = statustext_chunks(text, suffix=suffix, max_chunks=self.max_chunks)
        with self._lock:
            if self._closed:  # a delivery that outlived the dispatcher's wait in close()
                raise ConnectionError(f"the MAVLink hook is closed: {code} was not sent")
            if self._peers is not None:
                self._peers.learn()
            try:
                # The older ones first, whatever the state said a moment ago: a link
                # that got its destination since is tried, and while any is still
                # held the new one goes behind it (the link's thread, or the next
                # alert, sends them in order once the link takes them).
                refused = self._replay() if self._backlog.waiting else None
                if self._backlog.waiting:
                    raise NoDestinationError(f"{self._backlog.waiting} older ones held: {refused}")
                self._send(severity, chunks)
            except NoDestinationError as exc:
                self._backlog.hold(severity, text, suffix)
                raise NoDestinationError(
                    f"{exc}; held, sent late once the link is up ({self._backlog.waiting} held now)"
                ) from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            dropped = self._backlog.discard()
        if dropped:
            log.warning("mavlink_alerts_dropped_at_close", endpoint=self.endpoint, dropped=dropped)
        # Outside the lock: a link's thread waiting for it in ``_link_up`` sees the
        # hook closed and returns, so the joins below do not wait for it.
        if self._out is not None:
            self._out.close()
        if self._peers is not None:  # its reading thread ends before the socket closes
            self._peers.close()
        self._connection.close()

    def status(self) -> dict[str, Any]:
        """The link now and the alerts held for it.  ``state``: ``up`` (it has a
        destination), ``connecting`` (``tcp:``), ``no_peer`` (``udpin:``: no
        ground station heard yet), ``unresolved`` (``udpout:``: the name),
        ``unreachable`` (``udp*:``: no route to the address or the stations; the
        ``udpin:`` address or its interface not there yet), ``closed``, or
        ``unknown`` (an endpoint pymavlink keeps); ``destinations`` (the stations
        a ``udpin:`` answers, else 0 or 1); ``error`` (why it is down, where
        known); ``ignored`` (datagrams that taught no station); the held alerts'
        counts (``LinkBacklog.status``)."""
        with self._lock:
            state, destinations, error = self._link_state()
            ignored = self._peers.ignored if self._peers is not None else 0
            return {
                "state": state,
                "destinations": destinations,
                "error": error,
                "ignored": ignored,
                **self._backlog.status(),
            }

    @property
    def connected(self) -> bool:
        """Whether the link has a destination now: a ``tcp:`` link is up, a
        ``udpin:`` one heard a ground station, a ``udpout:`` name resolved, and
        a route to them."""
        return self._link_state()[0] == "up"

    def _link_state(self) -> tuple[str, int, str | None]:
        if self._closed:
            return "closed", 0, None
        if self._peers is not None:
            if self._peers.unbound is not None:
                return "unreachable", 0, self._peers.unbound
            heard, no_route = len(self._peers.addresses), self._peers.no_route
            if heard and no_route is not None:
                return "unreachable", heard, no_route
            return ("up" if heard else "no_peer"), heard, None
        if self._out is not None:
            state, error = self._out.state
            return state, int(state == "up"), error
        if isinstance(self._connection, TcpLink):
            error = self._connection.last_error
            return ("up", 1, None) if error is None else ("connecting", 0, error)
        return "unknown", 0, None

    def _send(self, severity: int, chunks: list[bytes]) -> None:
        """Call with the lock held."""
        if len(chunks) == 1:
            self._mav.statustext_send(severity, chunks[0])
            return
        message_id = self._next_id()
        for chunk_seq, chunk in enumerate(chunks):
            self._mav.statustext_send(severity, chunk, id=message_id, chunk_seq=chunk_seq)

    def _replay(self) -> str | None:
        """Send the held alerts, oldest first, while the link takes them; call
        with the lock held.  One it refuses stays held (until it expires): the
        next alert or the link coming up again tries again.  Returns why it was
        refused; logs unless nothing went and the link still has no destination
        (each alert raised while it is down tries)."""
        replayed, error, down = 0, None, False
        while (held := self._backlog.oldest()) is not None:
            late = max(1, round(self._backlog.clock() - held.raised_at))
            suffix = f"{held.suffix} ({late} s late)"
            try:
                self._send(
                    held.severity,
                    statustext_chunks(held.text, suffix=suffix, max_chunks=self.max_chunks),
                )
            except Exception as exc:  # OSError, NoDestinationError: the link's refusal
                error, down = repr(exc), isinstance(exc, NoDestinationError)
                break
            self._backlog.replayed_oldest()
            replayed += 1
        if replayed or (error is not None and not down):
            log.info(
                "mavlink_alerts_replayed",
                endpoint=self.endpoint,
                sent_late=replayed,
                error=error,
                waiting=self._backlog.waiting,
                expired=self._backlog.expired,
                overflowed=self._backlog.overflowed,
            )
        return error

    def _link_up(self) -> None:
        """A link's thread found a destination (a first ground station heard, a
        connection, the name resolved): send what is held."""
        try:
            with self._lock:
                if not self._closed and self._backlog.waiting:
                    self._replay()
        except Exception:  # a bug: never the end of the link's thread
            log.exception("mavlink_replay_failed", endpoint=self.endpoint)

    def _next_id(self) -> int:
        """Non-zero uint16, one per chunked text (0 means "not chunked")."""
        self._last_id = self._last_id % 0xFFFF + 1
        return self._last_id


def _tcp_link(endpoint: str, on_connected: Callable[[], None] | None = None) -> TcpLink:
    """``tcp:host:port`` (``tcp:[ipv6]:port``), as pymavlink spells it."""
    try:
        host, port = split_host_port(endpoint.removeprefix(_TCP_PREFIX))
    except ValueError as exc:
        raise ValueError(f"TCP endpoints are tcp:<host>:<port> ({exc})") from None
    if port == 0:
        raise ValueError("TCP endpoints are tcp:<host>:<port> (port 1..65535)")
    host.encode("idna")  # UnicodeError (a ValueError) for a name no resolver takes
    return TcpLink(host, port, on_connected=on_connected)
