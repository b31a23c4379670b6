"""The hooks that need no extra library: the PUB ``alert`` topic and the FDR."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inferd.fdr.kinds import RecordPayloadError
from inferd.types import AlertLevel, EventSink, RecordSink

#: Topic of alert events on the PUB socket.
ALERT_TOPIC = "alert"
#: Flight data recorder kind of an alert record.
ALERT_RECORD_KIND = "alert"
#: Key the dispatcher reserves in ``fields`` for the count of suppressed repeats.
SUPPRESSED_FIELD = "suppressed"
#: Key of an alert record that holds a sanitised copy: ``{"reason", "changed"}``.
SANITISED_KEY = "sanitised"
#: The alert the daemon raises when it serves without its flight data recorder
#: (``Daemon._start_recorder``): nothing handed to the record sink from then on is
#: written, so the fdr hook fails that alert and every later one, never counts them sent.
RECORDER_LOST_CODE = "fdr_unavailable"


class PubAlertHook:
    """Publishes ``{level, code, message, fields}`` on topic ``alert``.

    The suppressed-repeat count travels as ``fields["suppressed"]``, present
    only when > 0, so the payload keeps exactly the four keys of
    ``schemas/bus/event_alert.json``.
    """

    name = "pub"

    def __init__(self, events: EventSink) -> None:
        self._events = events

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        self._events(
            ALERT_TOPIC, {"level": level, "code": code, "message": message, "fields": dict(fields)}
        )

    def close(self) -> None:
        """Nothing to release: the service owns the PUB socket."""


class FdrAlertHook:
    """Records ``alert`` with payload ``{level, code, message, fields, suppressed}``.

    ``suppressed`` is taken out of ``fields`` into its own integer key (0 when
    nothing was suppressed), as the record kind requires.  A payload the recorder
    refuses (``RecordPayloadError``: a lone surrogate from ``os.fsdecode``, a value
    msgpack cannot pack, a body over the record limit) is recorded as a sanitised
    copy, with ``sanitised: {reason, changed}``; one whose copies are refused too
    fails the hook (the dispatcher counts and logs it), as does every alert once
    the daemon said it serves without its recorder (``fdr_unavailable``).
    """

    name = "fdr"

    def __init__(self, record: RecordSink) -> None:
        self._record = record
        #: Why the recorder is not running (the ``fdr_unavailable`` message), once it is not.
        self._recorder_lost: str | None = None

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        if code == RECORDER_LOST_CODE:  # set once, never cleared: the recorder never restarts
            self._recorder_lost = _escaped(message, _REASON_CHARS)
        if self._recorder_lost is not None:
            raise ConnectionError(f"the flight data recorder is not running: {self._recorder_lost}")
        details = dict(fields)
        suppressed = details.pop(SUPPRESSED_FIELD, 0)
        payload = {
            "level": level,
            "code": code,
            "message": message,
            "fields": details,
            "suppressed": suppressed if isinstance(suppressed, int) else 0,
        }
        try:
            self._record(ALERT_RECORD_KIND, payload)
        except RecordPayloadError as exc:
            self._record_sanitised(payload, exc)

    def _record_sanitised(self, payload: dict[str, Any], refused: RecordPayloadError) -> None:
        """A bounded copy (``_BOUNDS[0]``), else the smallest (level, code, the start
        of the message: it fits ``fdr.segment_max_bytes`` 1024); else raise."""
        reason = _escaped(str(refused), _REASON_CHARS)
        last = refused
        for bounds in _BOUNDS:
            try:
                self._record(ALERT_RECORD_KIND, _Sanitiser(bounds).payload(payload, reason))
                return
            except RecordPayloadError as exc:
                last = exc
        raise RecordPayloadError(f"alert record dropped: {reason}; its sanitised copy: {last}")

    def close(self) -> None:
        """Nothing to release: the service owns the recorder."""


@dataclass(frozen=True)
class _Bounds:
    message_chars: int
    #: Characters of each string in ``fields`` (and of a map key: 128 at most).
    value_chars: int
    #: Values in ``fields``, at every depth together; 0: ``fields`` is left empty.
    items: int
    #: A map or list at this depth (a field's own value is at 1) is recorded as its
    #: (bounded) ``repr``.
    depth: int


#: Tried in order: at most ~300 KiB, then a few hundred bytes.
_BOUNDS = (_Bounds(4096, 1024, 256, 4), _Bounds(200, 0, 0, 0))
_KEY_CHARS = 128
_REASON_CHARS = 300
#: The record's integer range (msgpack: int64 and uint64).
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1

_repr = reprlib.Repr()  # a bounded repr of what msgpack cannot pack (a huge list)
_repr.maxstring = _repr.maxother = 1024
_repr.maxlong = 64


def _escaped(text: str, limit: int) -> str:
    """``text`` as UTF-8 can hold it (a lone surrogate as ``\\udce9``), cut to
    ``limit`` characters (as ``cut_long_values`` says it)."""
    escaped = text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit or len(escaped) > limit:
        return f"{escaped[:limit]} [cut: {len(text)} characters]"
    return escaped


def _bounded_repr(value: Any) -> str:
    try:
        return _repr.repr(value)
    except Exception:  # a __repr__ that raises, an int over sys.get_int_max_str_digits
        return f"<{type(value).__name__}>"


class _Sanitiser:
    """One sanitised copy of an alert payload, within ``bounds``; ``changed``
    names what differs from the original (``code``, ``message``, ``fields.<key>``,
    or ``fields`` when some were left out)."""

    def __init__(self, bounds: _Bounds) -> None:
        self._bounds = bounds
        self._left = bounds.items
        self.changed: list[str] = []

    def payload(self, payload: Mapping[str, Any], reason: str) -> dict[str, Any]:
        code = _escaped(str(payload["code"]), _KEY_CHARS)
        message = _escaped(str(payload["message"]), self._bounds.message_chars)
        for name, clean in (("code", code), ("message", message)):
            if clean != payload[name]:
                self.changed.append(name)
        fields: dict[str, Any] = {}
        for key, value in payload["fields"].items():
            if self._left <= 0:
                self.changed.append("fields")  # the others are left out
                break
            name = _key(key)
            fields[name], differs = self._value(value, 1)
            if differs or name != key:
                self.changed.append(f"fields.{name}")
        return {
            "level": payload["level"],
            "code": code,
            "message": message,
            "fields": fields,
            "suppressed": payload["suppressed"],
            SANITISED_KEY: {"reason": reason, "changed": self.changed},
        }

    def _value(self, value: Any, depth: int) -> tuple[Any, bool]:
        """``value`` as a record holds it, and whether that differs from ``value``."""
        self._left -= 1
        if value is None or isinstance(value, (bool, float)):
            return value, False
        if isinstance(value, int) and _INT_MIN <= value <= _INT_MAX:
            return value, False
        if isinstance(value, str):
            clean = _escaped(value, self._bounds.value_chars)
            return clean, clean != value
        if depth < self._bounds.depth:
            if isinstance(value, Mapping):
                return self._map(value, depth + 1)
            if isinstance(value, (list, tuple)):
                items: list[Any] = []
                changed = False
                for item in value:
                    if self._left <= 0:
                        return items, True
                    clean, differs = self._value(item, depth + 1)
                    items.append(clean)
                    changed = changed or differs
                return items, changed
        return _escaped(_bounded_repr(value), self._bounds.value_chars), True

    def _map(self, value: Mapping[Any, Any], depth: int) -> tuple[dict[str, Any], bool]:
        items: dict[str, Any] = {}
        changed = False
        for key, item in value.items():
            if self._left <= 0:
                return items, True
            name = _key(key)
            items[name], differs = self._value(item, depth)
            changed = changed or differs or name != key
        return items, changed


def _key(key: Any) -> str:
    return _escaped(key if isinstance(key, str) else _bounded_repr(key), _KEY_CHARS)
