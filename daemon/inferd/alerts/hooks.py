"""The hooks that need no extra library: the PUB ``alert`` topic and the FDR."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferd.alerts.sanitise import KEY_BYTES, escaped, recut
from inferd.fdr.kinds import RecordPayloadError
from inferd.types import AlertLevel, EventSink, RecordSink

#: Topic of alert events on the PUB socket.
ALERT_TOPIC = "alert"
#: Flight data recorder kind of an alert record.
ALERT_RECORD_KIND = "alert"
#: Key the dispatcher reserves in ``fields`` for the count of suppressed repeats.
SUPPRESSED_FIELD = "suppressed"
#: Key the dispatcher reserves in ``fields`` for what it sanitised (``alerts.sanitise``):
#: ``{"reason", "changed"}``, present only when it changed something.  The FDR
#: record holds it as its own key; the PUB event leaves it out (``event_alert.json``
#: allows no other key, the C++ client refuses one).
SANITISED_FIELD = "sanitised"
#: The alert the daemon raises when it serves without its flight data recorder
#: (``Daemon._start_recorder``): nothing handed to the record sink from then on is
#: written, so the fdr hook fails that alert and every later one, never counts them sent.
RECORDER_LOST_CODE = "fdr_unavailable"


class PubAlertHook:
    """Publishes ``{level, code, message, fields}`` on topic ``alert``.

    The suppressed-repeat count travels as ``fields["suppressed"]``, present
    only when > 0, so the payload keeps exactly the four keys of
    ``schemas/bus/event_alert.json``.  The dispatcher's ``sanitised`` marker is
    left out: no code's fields in that schema allow it; the text says what was
    done (``\\udce9``, ``[cut: N characters]``).  The daemon's sink is the
    publisher's ``publish_alert``, which raises ``EventDroppedError`` (a
    ``ConnectionError``) for an event it drops (its queue full, the publisher
    stopped), so the dispatcher counts that alert a failure, not sent.
    """

    name = "pub"

    def __init__(self, events: EventSink) -> None:
        self._events = events

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        details = dict(fields)
        details.pop(SANITISED_FIELD, None)
        self._events(
            ALERT_TOPIC, {"level": level, "code": code, "message": message, "fields": details}
        )

    def close(self) -> None:
        """Nothing to release: the service owns the PUB socket."""


class FdrAlertHook:
    """Records ``alert`` with payload ``{level, code, message, fields, suppressed}``.

    ``suppressed`` is taken out of ``fields`` into its own integer key (0 when
    nothing was suppressed), as the record kind requires; so is ``sanitised``
    (``{reason, changed}``, present only when the dispatcher sanitised the alert:
    ``alerts.sanitise``).  An alert the recorder still refuses (``RecordPayloadError``:
    its sanitised form over ``fdr.segment_max_bytes``, or a hook called without
    the dispatcher) is recorded as the smallest copy (level, code, the message
    cut to 200 bytes of UTF-8, ``fields`` empty; it fits a segment of 1024 bytes); one
    refused too fails the hook (the dispatcher counts and logs it), as does every
    alert once the daemon said it serves without its recorder (``fdr_unavailable``),
    and one whose record the sink says it dropped: the daemon's sink is the
    recorder's ``record_alert``, which raises ``RecordDroppedError`` (a
    ``ConnectionError``) for a record it drops at once, as while its writer backs
    off after a failure (``fdr_write_outage``, which this hook thus never delivers).
    """

    name = "fdr"

    def __init__(self, record: RecordSink) -> None:
        self._record = record
        #: Why the recorder is not running (the ``fdr_unavailable`` message), once it is not.
        self._recorder_lost: str | None = None

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        if code == RECORDER_LOST_CODE:  # set once, never cleared: the recorder never restarts
            self._recorder_lost = escaped(message, _REASON_BYTES)
        if self._recorder_lost is not None:
            raise ConnectionError(f"the flight data recorder is not running: {self._recorder_lost}")
        details = dict(fields)
        suppressed = details.pop(SUPPRESSED_FIELD, 0)
        marker = details.pop(SANITISED_FIELD, None)
        payload = {
            "level": level,
            "code": code,
            "message": message,
            "fields": details,
            "suppressed": suppressed if isinstance(suppressed, int) else 0,
        }
        if marker is not None:
            payload[SANITISED_FIELD] = marker
        try:
            self._record(ALERT_RECORD_KIND, payload)
        except RecordPayloadError as exc:
            self._record_smallest(payload, exc)

    def _record_smallest(self, payload: dict[str, Any], refused: RecordPayloadError) -> None:
        """Level, code and the start of the message, with ``sanitised`` saying so
        (after what the dispatcher changed, if it did); else raise."""
        earlier = payload.get(SANITISED_FIELD) or {"reason": "", "changed": []}
        code = recut(str(payload["code"]), KEY_BYTES)
        message = recut(str(payload["message"]), _SMALLEST_MESSAGE_BYTES)
        # "fields" stands for every "fields.<key>" (up to 64, ``MAX_VALUES``, more
        # than a small segment holds): none is left.
        before = {str(name).partition(".")[0] for name in earlier["changed"]}
        differs = {
            "code": "code" in before or code != payload["code"],
            "message": "message" in before or message != payload["message"],
            "fields": "fields" in before or bool(payload["fields"]),
        }
        changed = [name for name, differ in differs.items() if differ]
        refusal = escaped(str(refused), _REASON_BYTES)
        reason = f"{earlier['reason']}; {refusal}" if earlier["reason"] else refusal
        smallest = {
            "level": payload["level"],
            "code": code,
            "message": message,
            "fields": {},
            "suppressed": payload["suppressed"],
            SANITISED_FIELD: {"reason": reason, "changed": changed},
        }
        try:
            self._record(ALERT_RECORD_KIND, smallest)
        except RecordPayloadError as exc:
            raise RecordPayloadError(
                f"alert record dropped: {refusal}; its smallest copy: {exc}"
            ) from exc

    def close(self) -> None:
        """Nothing to release: the service owns the recorder."""


_SMALLEST_MESSAGE_BYTES = 200
_REASON_BYTES = 300
