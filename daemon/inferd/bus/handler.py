"""What the bus asks of the service (``RequestHandler``) and what it sends back
(``Reply``): the contract between ``bus.server`` and ``serving.requests``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from inferd.bus.codec import Request
from inferd.bus.headers import Header
from inferd_wire import protocol
from inferd_wire.protocol import ProtocolError


@dataclass
class Reply:
    envelope: list[bytes]
    header: dict[str, Any]
    frames: Sequence[Any] = ()
    #: Which ROUTER the reply leaves on ("infer" or "control").
    socket: str = "infer"

    def parts(self) -> list[Any]:
        return [*self.envelope, protocol.pack(self.header), *self.frames]


def error_reply(request: Request | None, envelope: list[bytes], error: ProtocolError) -> Reply:
    request_id = request.request_id if request is not None else None
    return Reply(envelope, protocol.error_header(request_id, error.code, error.message))


class Prepared(Protocol):
    """A handler's prepared admission: opaque to the bus but for its header."""

    @property
    def header(self) -> Header: ...


class RequestHandler(Protocol):
    """What the service provides to the bus.  Called by one thread at a time: the
    bus thread, or the engine worker reading a request while idle."""

    def handle_infer(self, request: Request) -> Reply | None:
        """Admit a request (None: the engine worker replies) or refuse it (its reply)."""
        ...

    def prepared_for(self, route: bytes, repeat: bytes) -> Prepared | None:
        """What admitting an earlier request of the connection ``route`` (a shm
        connection's route or a ZeroMQ routing id) with the bytes ``repeat`` but
        for its id prepared, if it still holds: a message with those bytes is then
        admitted by ``admit_prepared`` (DESIGN.md 109, 114)."""
        ...

    def admit_prepared(self, prepared: Prepared, request: Request) -> Reply | None:
        """Admit a repeat (``request``: its id, route, frames and uid with
        ``prepared``'s header) or refuse it (``ProtocolError``) as ``handle_infer``
        would."""
        ...

    def handle_control(self, request: Request) -> Reply | None:
        """Answer a control op now, or return None when its reply comes later."""
        ...

    def due_replies(self, now_ns: int) -> list[Reply]:
        """Replies owed now: expired deadlines, superseded and shutdown-failed requests."""
        ...

    def next_wakeup_ns(self) -> int | None:
        """When ``due_replies`` next has work (e.g. the earliest queued deadline)."""
        ...
