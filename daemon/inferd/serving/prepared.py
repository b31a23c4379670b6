"""Admissions prepared for repeated requests (DESIGN.md 109, 114).

Once a request read from a shm connection has been admitted on an admission
plan (``bus.plans``), or a request of frames alone from the infer socket with
its inputs checked against the model, the router keeps what that admission
concluded under the connection's route (its ZeroMQ routing id on the infer
socket) and the message's (header frame's) bytes but for its id
(``bus.repeats``): the typed header, the plan, the deadline and the slot and
handle it was admitted for.  The next message on that connection with the same
bytes is the same header but for its id, so it is admitted from here without
being decoded, planned or checked against the model again: only what can
change between two identical requests is done again (the daemon still
accepting, the slot still serving the same handle, the in-flight bound, the
leases with their owner and range checks or the frames' count and lengths,
the views, the deadline, the queue).

At most ``MAX_PREPARED`` are kept, ``MAX_PREPARED_PER_CONNECTION`` of them one
connection's, the oldest dropped; a closed connection's route is never used
again, so its entries only wait to be dropped.  A ZeroMQ peer chooses its own
routing id, so another peer may take over a routing id used before, or choose
one with a shm route's bytes: what is kept under one depends on nothing of the
peer (frames alone), and a request with regions is kept only when it was read
on ``shm.sock`` (its ``local_uid`` set; never told by its route's bytes), under
its connection's route, whose uid is fixed (its placement is leased for that
uid).
Nothing here holds a view or a lease: the regions are leased per request by
id, and the tensors placed as the last time when the regions leased are the
same objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferd.bus.headers import InferHeader
from inferd.bus.plans import AdmissionPlan
from inferd.serving.slot import ModelSlot
from inferd.shm.leases import Placement
from inferd.types import EngineHandle

#: Prepared admissions kept (a camera loop needs one per connection; a message is
#: at most 16 KiB, so this bounds them to 1 MiB).
MAX_PREPARED = 64
#: Of which one connection's: one sending ever new requests replaces its own.
MAX_PREPARED_PER_CONNECTION = 16


@dataclass
class PreparedRequest:
    """What admitting a request concluded, for the next with the same bytes."""

    slot: ModelSlot
    #: The engine the plan was checked against.
    handle: EngineHandle
    #: The typed header of the request it was prepared from (its ``id`` is that
    #: request's; a repeat's id is the one it carries).
    header: InferHeader
    plan: AdmissionPlan
    deadline_ms: int
    #: Where the last admitted one's region tensors were: a repeat whose regions
    #: are the same objects is placed there without the range checks (sizes
    #: unchanged).  None for a request of frames alone: a repeat's frames are
    #: checked against the plan's inputs (count, then each length).
    placement: Placement | None


class PreparedRequests:
    """The prepared admissions by (route, bytes but for the id); used by the one
    thread admitting at a time."""

    def __init__(self) -> None:
        self._prepared: dict[tuple[bytes, bytes], PreparedRequest] = {}
        #: Requests admitted from a prepared admission, and admissions prepared.
        self.used = 0
        self.made = 0

    def get(self, route: bytes, prefix: bytes) -> PreparedRequest | None:
        return self._prepared.get((route, prefix))

    def remember(
        self, route: bytes, prefix: bytes, prepared: PreparedRequest, local_uid: int | None
    ) -> None:
        """Keep ``prepared`` for the repeats of ``route`` with the bytes ``prefix``;
        ``local_uid``: the request's (set when it was read on ``shm.sock``)."""
        if prepared.placement is not None and local_uid is None:
            # On the infer socket the uid is the header frame's, per message, and a
            # routing id may pass to a peer of another uid, whatever its bytes (one
            # shaped like a shm route too): leasing the placement for a repeat
            # would skip the regions' owner check (two reviews found it).
            return
        key = (route, prefix)
        if key not in self._prepared:
            own = [known for known in self._prepared if known[0] == route]
            if len(own) >= MAX_PREPARED_PER_CONNECTION:
                del self._prepared[own[0]]  # its oldest
            elif len(self._prepared) >= MAX_PREPARED:
                del self._prepared[next(iter(self._prepared))]  # the oldest
        self._prepared[key] = prepared
        self.made += 1

    def __len__(self) -> int:
        return len(self._prepared)
