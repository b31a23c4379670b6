"""Reply bytes in flight, per peer and in total: the bound on what replies hold
between the bus handing them to ZeroMQ and ZeroMQ writing them to the peer's
connection.

ZeroMQ's ``SNDHWM`` counts messages, not bytes, and the daemon cannot look
into a peer's pipe.  So the bus sends each reply's last frame as a zero-copy
view and the budget keeps only a weak reference to that view: ZeroMQ lets go
of a message once its I/O thread has written it to the connection, or has
dropped it with the pipe of a peer that left, and pyzmq's garbage collector
then releases the view.  A peer's pipe is first in, first out, so once a
reply's last frame is released the whole reply, and every earlier one to that
peer, has left the daemon's memory (DESIGN.md 56).

A reply to a peer that already has ``per_peer_bytes`` in flight, or that
would take the total over ``total_bytes``, is dropped: the peer does not read.
Every drop is counted (per peer and in total), the first drop of a peer is
logged once, and ``status`` lists the peers that lost replies.  A peer with
nothing in flight always gets its reply if the total allows, however large it
is, so a single big result is never refused to a client that reads.

Releases lag: ZeroMQ lets go of a message on its I/O thread's next turn after
the last byte left, and pyzmq's garbage collector thread needs the GIL to drop
its reference, so a client reading big replies back to back may have read the
previous one while its view still lives.  Before a refusal the budget waits,
up to ``RELEASE_GRACE_S`` and with the GIL released, for views to die; a peer
whose last reply was dropped gets no such wait, so a peer that does not read
costs the sender one grace per episode, not one per reply (DESIGN.md 117).  A
peer that reads, but slower than its replies come, ends an episode with each
reply it takes.  So when a grace runs out for a peer a second time within
``GRACE_HOLDOFF_S``, its refusals wait none for ``GRACE_HOLDOFF_S``: one such
peer costs the sender about two graces a second, where it cost one per reply
it read.  A client that reads, whose releases lagged past one grace on a loaded
machine, keeps its graces (DESIGN.md 251).  A refusal for the total budget
counts against graces of all peers together: the peer refused may be reading,
its reply refused for others' backlogs, and is not held off for them; the
sender still waits out about two such graces a second at most (DESIGN.md 280).
``status`` counts the graces waited, those that ran out, the refusals a holdoff
kept from waiting one (by reason), and the seconds waited (DESIGN.md 284).

Used under the bus's wire lock (the bus thread's and the engine worker's sends).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import zmq

from inferd.bus.heap import BULK_RELEASE_BYTES, HeapTrimmer
from inferd_wire import protocol

log = structlog.get_logger("inferd.bus")

#: (socket name, routing id): routing ids are per ROUTER socket.
PeerKey = tuple[str, bytes]

#: How many peers that lost replies ``status`` lists (the most recent).
MAX_LISTED_PEERS = 64
#: What marks the digest ``status`` and the log show in place of a routing id.
#: Never the id: one libzmq's ROUTER generated (0x00 and a 32-bit counter) told a
#: client the next ids to claim, and a claimed id the ROUTER then generates aborts
#: the daemon (``bus/binding.py``); one a client chose (inferd's clients choose 16
#: random bytes) could be claimed by whoever reads ``status`` once that client
#: had gone, and the replies still routed to it would go to the claimer.
DIGEST_MARK = "digest:"
#: The key of those digests, drawn at start: they tell peers apart, and match the
#: log's, within one run only, and without the key no id can be tested against one.
_DIGEST_KEY = os.urandom(16)

#: Why a reply was dropped.
PEER_BUDGET = "peer_budget"
TOTAL_BUDGET = "total_budget"
HIGH_WATER_MARK = "hwm"

#: How long a refusal waits for replies ZeroMQ may already have let go of to be
#: released (the sender waits, under the bus's wire lock): see the module doc.
RELEASE_GRACE_S = 0.02
#: Two graces that ran out for a peer within this long: its refusals wait none for as long.
GRACE_HOLDOFF_S = 1.0


@dataclass
class _Graces:
    """When a grace last ran out, and until when refusals wait none
    (``ReplyBudget.clock``): two that ran out within ``GRACE_HOLDOFF_S`` start
    a holdoff of as long."""

    ran_out_at: float = -GRACE_HOLDOFF_S
    none_until: float = 0.0

    def held_off(self, now: float) -> bool:
        return now < self.none_until

    def ran_out(self, now: float) -> None:
        if now - self.ran_out_at < GRACE_HOLDOFF_S:
            self.none_until = now + GRACE_HOLDOFF_S
        self.ran_out_at = now


@dataclass
class _Peer:
    socket: str
    routing_id: bytes
    #: (bytes, weak reference to the reply's last frame), oldest first.
    in_flight: deque[tuple[int, weakref.ReferenceType[Any]]] = field(default_factory=deque)
    nbytes: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    #: Whether the last reply for this peer was dropped (no grace for the next).
    dropping: bool = False
    #: Its graces for its own backlog (``PEER_BUDGET``).
    graces: _Graces = field(default_factory=_Graces)


def message_bytes(parts: Sequence[Any]) -> int:
    """Bytes of a multipart message's parts (bytes, frames or arrays)."""
    return sum(memoryview(part).nbytes for part in parts)


class ReplyBudget:
    def __init__(
        self, per_peer_bytes: int, total_bytes: int, trimmer: HeapTrimmer | None = None
    ) -> None:
        self.per_peer_bytes = per_peer_bytes
        self.total_bytes = total_bytes
        self._trimmer = trimmer
        #: Peers with replies in flight.
        self._busy: dict[PeerKey, _Peer] = {}
        #: Peers that lost replies, least recently dropping first.
        self._listed: OrderedDict[PeerKey, _Peer] = OrderedDict()
        self.in_flight_bytes = 0
        #: Replies handed to ZeroMQ, by socket.
        self.sent_replies: dict[str, int] = {"infer": 0, "control": 0}
        self.dropped = 0
        self.dropped_bytes = 0
        #: Set when a watched view dies (``watched``): ``refusal``'s grace waits on it.
        self._released = threading.Event()
        #: The clock of ``GRACE_HOLDOFF_S``.
        self.clock = time.monotonic
        #: Graces for the total budget, whoever's reply was refused.
        self._total_graces = _Graces()
        #: Refusals that waited a grace, and of those the ones that ran out (the
        #: reply dropped); refusals a holdoff kept from one, by reason; seconds
        #: waited.  Only refusals count them: a reply that fits costs nothing.
        self.graces_waited = 0
        self.graces_ran_out = 0
        self.graces_held_off: dict[str, int] = {PEER_BUDGET: 0, TOTAL_BUDGET: 0}
        self.grace_waited_s = 0.0

    def watched(self, part: Any) -> tuple[zmq.Frame, weakref.ReferenceType[Any]]:
        """``part`` as a zero-copy frame, and a weak reference that dies once ZeroMQ
        and pyzmq let go of it (the frame must not be kept: it holds the view too)."""
        view = np.frombuffer(part, np.uint8)
        return zmq.Frame(view, copy=False), self.watch(view)

    def watch(self, held: Any) -> weakref.ReferenceType[Any]:
        """A weak reference to what holds a reply's bytes; its death wakes a
        refusal's grace."""
        return weakref.ref(held, self._on_release)

    def _on_release(self, _reference: weakref.ReferenceType[Any]) -> None:
        self._released.set()  # on whichever thread let go of it last

    def refusal(self, socket: str, routing_id: bytes, nbytes: int) -> str | None:
        """Why a reply of ``nbytes`` may not be sent now (``PEER_BUDGET`` or
        ``TOTAL_BUDGET``, counted as a drop), or None: send it."""
        reason = self._over(socket, routing_id, nbytes)
        if reason is None:
            return None
        # Decided on what is in flight now, not at the loop's last collect():
        # a client reading big replies back to back has often had the previous
        # one written since (bench/rtt.py's 25 MB frames lost replies to that).
        self._released.clear()  # a release from here on ends the grace's wait
        self.collect()
        reason = self._over(socket, routing_id, nbytes)
        key = (socket, routing_id)
        peer = self._busy.get(key) or self._listed.get(key)
        graced = False
        if reason is not None and not (peer is not None and peer.dropping):
            # The graces asked are the ones struck if it runs out, whatever the reason
            # then: a release of the peer's own reply during the wait may leave it
            # refused for the total, and striking the total then let a slow reader
            # escape its own holdoff.
            graces = self._graces(reason, peer)
            if graces.held_off(self.clock()):
                self.graces_held_off[reason] += 1
            else:
                graced = True
        if graced:
            self.graces_waited += 1
            started = time.monotonic()
            give_up = started + RELEASE_GRACE_S
            while reason is not None and self._released.wait(give_up - time.monotonic()):
                self._released.clear()
                self.collect()
                reason = self._over(socket, routing_id, nbytes)
            self.grace_waited_s += time.monotonic() - started
        if reason is not None:
            # The peer looked at, even if a release during the grace emptied it: the
            # graces struck below are its own, and listed with it they last.
            self.drop(socket, routing_id, nbytes, reason, peer)
            if graced:
                self.graces_ran_out += 1
                graces.ran_out(self.clock())
        return reason

    def _graces(self, reason: str, peer: _Peer | None) -> _Graces:
        """The graces a refusal for ``reason`` counts against: the peer's own for
        its backlog, everyone's for the total, which other peers' backlogs fill (a
        peer that reads is not held off for them)."""
        if reason == PEER_BUDGET and peer is not None:
            return peer.graces
        return self._total_graces

    def notice(
        self, socket: str, routing_id: bytes, parts: Sequence[Any], nbytes: int, reason: str
    ) -> list[Any]:
        """What goes in place of a reply refused for ``reason``: its envelope and an
        error header with the same request id (``RESOURCE_EXHAUSTED`` and the
        numbers), a few bytes outside the budget, so that a client that reads
        after all learns which request to send again instead of waiting out its
        timeout.  ``parts``: the reply, ``[*envelope, header, *frames]``."""
        # The envelope is the routing id, and a REQ peer's empty delimiter.
        header_at = 2 if isinstance(parts[1], bytes) and not parts[1] else 1
        try:
            request_id = protocol.unpack_header(parts[header_at], check_version=False).get("id")
        except protocol.ProtocolError:  # not a header of ours: say so without an id
            request_id = None
        if reason == PEER_BUDGET:
            peer = self._busy.get((socket, routing_id))
            held = f"{peer.nbytes if peer else 0} bytes of this client's earlier replies"
            limit = f"bus.max_reply_bytes_per_peer = {self.per_peer_bytes}"
        else:
            held = f"{self.in_flight_bytes} bytes of replies to all clients"
            limit = f"bus.max_reply_bytes_total = {self.total_bytes}"
        message = (
            f"reply not sent: its {nbytes} bytes would join {held} not yet read "
            f"({limit}); read replies before sending more requests"
        )
        header = protocol.error_header(request_id, protocol.Code.RESOURCE_EXHAUSTED, message)
        return [*parts[:header_at], protocol.pack(header)]

    def _over(self, socket: str, routing_id: bytes, nbytes: int) -> str | None:
        peer = self._busy.get((socket, routing_id))
        peer_bytes = peer.nbytes if peer is not None else 0
        if peer_bytes and peer_bytes + nbytes > self.per_peer_bytes:
            return PEER_BUDGET
        if self.in_flight_bytes and self.in_flight_bytes + nbytes > self.total_bytes:
            return TOTAL_BUDGET
        return None

    def outgoing(
        self, socket: str, routing_id: bytes, parts: list[Any], nbytes: int
    ) -> tuple[list[Any], weakref.ReferenceType[Any] | None]:
        """What to send for the reply ``parts`` of ``nbytes``: the reply with its
        last frame watched (and the watch, for ``sent``), or the ``notice`` in
        its place (and None) when the budget refuses it, a refusal counted."""
        reason = self.refusal(socket, routing_id, nbytes)
        if reason is not None:
            return self.notice(socket, routing_id, parts, nbytes, reason), None
        parts[-1], last = self.watched(parts[-1])
        return parts, last

    def sent(
        self, socket: str, routing_id: bytes, nbytes: int, last: weakref.ReferenceType[Any] | None
    ) -> None:
        """Account for a reply handed to ZeroMQ; ``last`` watches its last frame
        (None: a notice, outside the budget)."""
        if last is None:
            return
        key = (socket, routing_id)
        peer = self._busy.get(key)
        if peer is None:
            peer = self._listed.get(key) or _Peer(socket, routing_id)
            self._busy[key] = peer
        peer.in_flight.append((nbytes, last))
        peer.nbytes += nbytes
        peer.dropping = False
        self.in_flight_bytes += nbytes
        self.sent_replies[socket] = self.sent_replies.get(socket, 0) + 1

    def drop(
        self, socket: str, routing_id: bytes, nbytes: int, reason: str, peer: _Peer | None = None
    ) -> _Peer:
        """Count a reply that was not sent because the peer does not read; its peer
        (``peer``: the one the refusal looked at, kept even if a release emptied it)."""
        key = (socket, routing_id)
        peer = peer or self._busy.get(key) or self._listed.get(key) or _Peer(socket, routing_id)
        if peer.dropped == 0:
            log.warning(
                "replies_dropped_peer_not_reading",
                socket=socket,
                peer=shown_routing_id(routing_id),
                reason=reason,
                reply_bytes=nbytes,
                peer_in_flight_bytes=peer.nbytes,
                in_flight_bytes=self.in_flight_bytes,
                max_reply_bytes_per_peer=self.per_peer_bytes,
                max_reply_bytes_total=self.total_bytes,
            )
        peer.dropped += 1
        peer.dropped_bytes += nbytes
        peer.dropping = True
        self.dropped += 1
        self.dropped_bytes += nbytes
        self._listed[key] = peer
        self._listed.move_to_end(key)
        if len(self._listed) > MAX_LISTED_PEERS:
            self._listed.popitem(last=False)
        return peer

    def collect(self) -> None:
        """Release the bytes of replies ZeroMQ has let go of (every loop pass)."""
        if not self._busy:
            return
        released = 0
        for key, peer in list(self._busy.items()):
            in_flight = peer.in_flight
            while in_flight and in_flight[0][1]() is None:
                nbytes, _ = in_flight.popleft()
                peer.nbytes -= nbytes
                released += nbytes
            if not in_flight:
                del self._busy[key]
        self.in_flight_bytes -= released
        # A backlog released at once: a peer that stopped reading caught up or
        # left; give the memory it held back to the kernel.
        if self._trimmer is not None and released >= BULK_RELEASE_BYTES:
            self._trimmer.request(time.monotonic_ns())

    def status(self) -> dict[str, Any]:
        return {
            "in_flight_bytes": self.in_flight_bytes,
            "in_flight_peers": len(self._busy),
            "max_bytes_per_peer": self.per_peer_bytes,
            "max_bytes_total": self.total_bytes,
            "sent": dict(self.sent_replies),
            "dropped": self.dropped,
            "dropped_bytes": self.dropped_bytes,
            "graces": {
                "waited": self.graces_waited,
                "ran_out": self.graces_ran_out,
                "held_off": dict(self.graces_held_off),
                "waited_s": self.grace_waited_s,
            },
            "dropping_peers": [
                {
                    "socket": peer.socket,
                    "peer": shown_routing_id(peer.routing_id),
                    "dropped": peer.dropped,
                    "dropped_bytes": peer.dropped_bytes,
                    "in_flight_bytes": peer.nbytes,
                }
                # copied in one C call: the metrics thread reads status() too
                for peer in reversed(list(self._listed.values()))
            ],
        }


def shown_routing_id(routing_id: bytes) -> str:
    """``routing_id`` as ``status`` and the log show it: ``digest:`` and 16 hex digits
    of a digest of all its bytes keyed per run (``DIGEST_MARK``), whatever its
    length (1 to 255 bytes: 23 characters each in a 64-peer list)."""
    digest = hashlib.blake2b(routing_id, key=_DIGEST_KEY, digest_size=8)
    return DIGEST_MARK + digest.hexdigest()
