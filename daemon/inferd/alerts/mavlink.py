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

pymavlink is imported when a hook is built, never at module import, so the
daemon runs without it unless the ``mavlink`` hook is configured.
"""

from __future__ import annotations

import threading
import unicodedata
from collections.abc import Mapping
from typing import Any

from inferd.alerts.hooks import SUPPRESSED_FIELD
from inferd.alerts.interface import AlertHookUnavailableError
from inferd.alerts.levels import mav_severity
from inferd.alerts.tcp_link import TcpLink
from inferd.alerts.udp_link import UdpOut, UdpPeers
from inferd.types import AlertLevel

#: Length of STATUSTEXT's ``text`` field (``char[50]``).
STATUSTEXT_LEN = 50
#: Default chunk budget: 199 characters, four messages.
DEFAULT_MAX_CHUNKS = 4
#: ``chunk_seq`` is a uint8.
MAX_CHUNKS_LIMIT = 256
_ELLIPSIS = "..."
_TCP_PREFIX = "tcp:"


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
    body = _printable_ascii(text).encode("ascii")
    tail = _printable_ascii(suffix).encode("ascii")
    data = body + tail
    if len(data) <= STATUSTEXT_LEN:
        return [data]
    # A chunked text must end in a chunk shorter than 50 (it carries the NUL).
    limit = STATUSTEXT_LEN if max_chunks == 1 else STATUSTEXT_LEN * max_chunks - 1
    if len(data) > limit:
        keep = max(limit - len(tail) - len(_ELLIPSIS), 0)
        data = (body[:keep].rstrip() + _ELLIPSIS.encode() + tail)[:limit]
    if len(data) <= STATUSTEXT_LEN:
        return [data]
    if len(data) % STATUSTEXT_LEN == 0:
        data += b" "
    return [data[start : start + STATUSTEXT_LEN] for start in range(0, len(data), STATUSTEXT_LEN)]


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
    answer fails.  A ``tcp:``
    endpoint is a ``TcpLink``: connected in the background (the daemon never
    waits for its ground station) and every frame it cannot send raises, so
    the dispatcher counts the alert as a failure rather than as sent.

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
        try:
            if endpoint.startswith(_TCP_PREFIX):
                connection: Any = _tcp_link(endpoint)
            else:
                connection = mavutil.mavlink_connection(
                    endpoint, source_system=source_system, source_component=source_component
                )
        except Exception as exc:
            raise AlertHookUnavailableError(
                self.name, f"cannot open MAVLink endpoint {endpoint!r}: {exc}"
            ) from None
        self.endpoint = endpoint
        self.mavlink2 = mavlink2
        self.max_chunks = max_chunks if mavlink2 else 1
        self._connection = connection
        #: Whom a ``udpin:`` endpoint answers; None for the other endpoints.
        self._peers: UdpPeers | None = None
        #: Where a ``udpout:`` endpoint sends; None for the other endpoints.
        self._out: UdpOut | None = None
        file: Any = connection
        if getattr(connection, "udp_server", False):
            file = self._peers = UdpPeers(connection.port, endpoint)
            try:
                self._peers.listen()
            except Exception as exc:  # the reading thread cannot start
                connection.close()
                raise AlertHookUnavailableError(self.name, f"{endpoint!r}: {exc}") from None
        elif isinstance(getattr(connection, "destination_addr", None), tuple) and not getattr(
            connection, "broadcast", False
        ):
            host, port = connection.destination_addr
            try:
                file = self._out = UdpOut(connection.port, host, port, endpoint)
            except Exception as exc:  # the resolving thread cannot start
                connection.close()
                raise AlertHookUnavailableError(self.name, f"{endpoint!r}: {exc}") from None
        # Our own encoder, so the wire version is what was asked for and not
        # what pymavlink's process-wide dialect (``MAVLINK20``) happens to be.
        self._mav: Any = dialect.MAVLink(
            file, srcSystem=source_system, srcComponent=source_component
        )
        self._lock = threading.Lock()
        self._closed = False
        self._last_id = 0

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        severity = mav_severity(level)
        suppressed = fields.get(SUPPRESSED_FIELD, 0)
        chunks = statustext_chunks(
            f"{code}: {message}",
            suffix=repeats_suffix(suppressed if isinstance(suppressed, int) else 0),
            max_chunks=self.max_chunks,
        )
        with self._lock:
            if self._closed:  # a delivery that outlived the dispatcher's wait in close()
                raise ConnectionError(f"the MAVLink hook is closed: {code} was not sent")
            if self._peers is not None:
                self._peers.learn()
            if len(chunks) == 1:
                self._mav.statustext_send(severity, chunks[0])
                return
            message_id = self._next_id()
            for chunk_seq, chunk in enumerate(chunks):
                self._mav.statustext_send(severity, chunk, id=message_id, chunk_seq=chunk_seq)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._out is not None:
                self._out.close()
            if self._peers is not None:  # its reading thread ends before the socket closes
                self._peers.close()
            self._connection.close()

    def _next_id(self) -> int:
        """Non-zero uint16, one per chunked text (0 means "not chunked")."""
        self._last_id = self._last_id % 0xFFFF + 1
        return self._last_id

    @property
    def connected(self) -> bool:
        """Whether a ``tcp:`` link is up; a datagram endpoint has no connection."""
        return bool(getattr(self._connection, "connected", True))


def _tcp_link(endpoint: str) -> TcpLink:
    """``tcp:host:port``, as pymavlink spells it."""
    host, _, port = endpoint.removeprefix(_TCP_PREFIX).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("TCP endpoints are tcp:<host>:<port>")
    host.encode("idna")  # UnicodeError (a ValueError) for a name no resolver takes
    return TcpLink(host, int(port))
