"""The pipe between the daemon and a build child: one codec for both ends.

The daemon (``inferd.engine_build.supervisor``) starts one build child
(``python -m inferd.engine_build.child SPEC_JSON``) per ``build.start``.  They talk
msgpack maps (``use_bin_type``; decoded with ``raw=False``) in both directions:

* the child's stdin (daemon -> child): ``{"op": "cancel", "source": ...,
  "reason": ...}`` (``CancelCommand``).  EOF (the daemon went away) cancels with
  source ``sigterm``.
* the child's original stdout (child -> daemon), in this order:
  ``{"kind": "engine_path", "path": ...}`` (where the engine will be written),
  any number of ``{"kind": "event", "event": BuildEvent.as_dict()}`` and
  ``{"kind": "record", "payload": ...}`` (the ``engine_build`` FDR payload,
  recorded by the daemon), and finally either ``{"kind": "report", "summary":
  ..., "summaryPath": ..., "droppedInChild": ...}`` or, when the build could not
  run at all, ``{"kind": "error", "error": ...}``.  File descriptor 1 of the child
  is pointed at stderr, so nothing printed by a library corrupts the stream.

``encode`` turns a message into bytes; ``Decoder`` is incremental (a message may
arrive split across reads, several in one read) and refuses a malformed one
(not a map, an unknown kind or op, a missing or mistyped field, an event of a
type not in ``events.EVENT_TYPES`` or a step outside 0..``MAX_STEP``, undecodable
bytes): it is logged, counted in ``Decoder.malformed`` and skipped, never raised.
It holds at most ``MAX_MESSAGE_BYTES`` of one unfinished message: a longer one is
refused and, its end being unknown, so is the rest of the stream (``broken``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack
import structlog

from inferd.engine_build.events import EVENT_TYPES, BuildEvent

log = structlog.get_logger("inferd.builds.pipe")

T = TypeVar("T")

#: The longest message a decoder buffers (a build's report, the largest, is a few
#: hundred KiB: one phase tree); msgpack's own default bound is 100 MiB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class MalformedMessage(ValueError):
    """A decoded msgpack object that is not a message of this protocol."""


# -- messages -------------------------------------------------------------------------
@dataclass(frozen=True)
class CancelCommand:
    """daemon -> child: cancel the build (sets the child's ``CancellationToken``)."""

    source: str
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"op": "cancel", "source": self.source, "reason": self.reason}


@dataclass(frozen=True)
class EventMessage:
    event: BuildEvent

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "event", "event": self.event.as_dict()}


@dataclass(frozen=True)
class EnginePathMessage:
    path: str

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "engine_path", "path": self.path}


@dataclass(frozen=True)
class RecordMessage:
    payload: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "record", "payload": dict(self.payload)}


@dataclass(frozen=True)
class ReportMessage:
    summary: dict[str, Any]
    summary_path: str
    dropped_in_child: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": "report",
            "summary": self.summary,
            "summaryPath": self.summary_path,
            "droppedInChild": self.dropped_in_child,
        }


@dataclass(frozen=True)
class ErrorMessage:
    error: str

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "error", "error": self.error}


#: child -> daemon.
ChildMessage = EventMessage | EnginePathMessage | RecordMessage | ReportMessage | ErrorMessage


def encode(message: CancelCommand | ChildMessage) -> bytes:
    packed: bytes = msgpack.packb(message.to_wire(), use_bin_type=True)
    return packed


# -- parsing --------------------------------------------------------------------------
def _field(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in data:
        raise MalformedMessage(f"missing {key!r}")
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise MalformedMessage(f"{key!r} is {type(value).__name__}")
    return value


def _optional(data: Mapping[str, Any], key: str, kind: type) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise MalformedMessage(f"{key!r} is {type(value).__name__}")
    return value


#: The largest ``step`` and ``numSteps`` taken (int64): a uint64 past it made the
#: daemon's view of the phase (``completedSteps``, ``step + 1``) unpackable.
MAX_STEP = 2**63 - 1


def _count(data: Mapping[str, Any], key: str) -> int | None:
    value: int | None = _optional(data, key, int)
    if value is not None and not 0 <= value <= MAX_STEP:
        raise MalformedMessage(f"{key!r} is outside 0..{MAX_STEP}")
    return value


def _event_type(data: Mapping[str, Any]) -> str:
    value: str = _field(data, "type", str)
    if value not in EVENT_TYPES:  # any string was kept (``PhaseTree.last_event``)
        raise MalformedMessage(f"'type' is not one of {', '.join(EVENT_TYPES)}")
    return value


def event_from_dict(data: Mapping[str, Any]) -> BuildEvent:
    """The inverse of ``BuildEvent.as_dict``; ``MalformedMessage`` if it is not one
    (a ``type`` not in ``EVENT_TYPES``, a ``step`` or ``numSteps`` outside 0..``MAX_STEP``)."""
    detail = data.get("detail") or {}
    if not isinstance(detail, dict):
        raise MalformedMessage("'detail' is not a map")
    return BuildEvent(
        build_id=_field(data, "buildId", str),
        seq=_field(data, "seq", int),
        type=_event_type(data),
        phase_id=_optional(data, "phaseId", str),
        parent_id=_optional(data, "parentId", str),
        name=_optional(data, "name", str),
        step=_count(data, "step"),
        num_steps=_count(data, "numSteps"),
        mono_ns=_field(data, "monotonicNs", int),
        wall_ns=_field(data, "wallNs", int),
        thread=_field(data, "thread", str),
        cancel_state=_field(data, "cancelState", str),
        detail=dict(detail),
    )


def parse_child_message(obj: object) -> ChildMessage:
    """A decoded map from the child's stdout as a message (``MalformedMessage`` if not)."""
    if not isinstance(obj, dict):
        raise MalformedMessage(f"not a map but {type(obj).__name__}")
    kind = obj.get("kind")
    if kind == "event":
        return EventMessage(event_from_dict(_field(obj, "event", dict)))
    if kind == "engine_path":
        return EnginePathMessage(_field(obj, "path", str))
    if kind == "record":
        return RecordMessage(dict(_field(obj, "payload", dict)))
    if kind == "report":
        return ReportMessage(
            summary=_field(obj, "summary", dict),
            summary_path=_field(obj, "summaryPath", str),
            dropped_in_child=_optional(obj, "droppedInChild", int) or 0,
        )
    if kind == "error":
        return ErrorMessage(str(obj.get("error")))
    raise MalformedMessage(f"unknown kind {kind!r}")


def parse_command(obj: object) -> CancelCommand:
    """A decoded map from the child's stdin as a command (``MalformedMessage`` if not)."""
    if not isinstance(obj, dict) or obj.get("op") != "cancel":
        raise MalformedMessage("not a cancel op")
    return CancelCommand(str(obj.get("source", "control")), str(obj.get("reason", "")))


# -- incremental decoding -------------------------------------------------------------
class Decoder(Generic[T]):
    """Feed it bytes as they arrive; it returns the complete, well-formed messages."""

    def __init__(self, parse: Callable[[object], T], stream: str, **context: Any) -> None:
        self._parse = parse
        self._context = {"stream": stream, **context}
        self._unpacker = self._new_unpacker()
        #: Messages refused so far (each one logged).
        self.malformed = 0
        #: Why the rest of the stream is dropped (None: it is read).
        self.broken: str | None = None

    @staticmethod
    def _new_unpacker() -> msgpack.Unpacker:
        return msgpack.Unpacker(raw=False, max_buffer_size=MAX_MESSAGE_BYTES)

    def feed(self, chunk: bytes) -> list[T]:
        if self.broken is not None:
            return []
        try:
            self._unpacker.feed(chunk)
        except msgpack.BufferFull:
            self.broken = f"a message larger than {MAX_MESSAGE_BYTES} bytes"
            self._refuse(f"{self.broken}: it and the rest of the stream are dropped")
            self._unpacker = self._new_unpacker()
            return []
        messages: list[T] = []
        while True:
            try:
                obj = next(self._unpacker)
            except StopIteration:
                return messages
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                # Undecodable bytes: the stream cannot be resynchronised; start afresh.
                self._refuse(f"undecodable: {type(exc).__name__}: {exc}")
                self._unpacker = self._new_unpacker()
                return messages
            try:
                messages.append(self._parse(obj))
            except (MalformedMessage, KeyError, TypeError, ValueError) as exc:
                self._refuse(str(exc))

    def _refuse(self, why: str) -> None:
        self.malformed += 1
        log.warning(
            "build_pipe_malformed_message", why=why, malformed=self.malformed, **self._context
        )


def child_message_decoder(**context: Any) -> Decoder[ChildMessage]:
    """The daemon's decoder of a build child's stdout."""
    return Decoder(parse_child_message, "child->daemon", **context)


def command_decoder(**context: Any) -> Decoder[CancelCommand]:
    """The build child's decoder of its stdin."""
    return Decoder(parse_command, "daemon->child", **context)
