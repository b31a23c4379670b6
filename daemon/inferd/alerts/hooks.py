"""The hooks that need no extra library: the PUB ``alert`` topic and the FDR."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferd.types import AlertLevel, EventSink, RecordSink

#: Topic of alert events on the PUB socket.
ALERT_TOPIC = "alert"
#: Flight data recorder kind of an alert record.
ALERT_RECORD_KIND = "alert"
#: Key the dispatcher reserves in ``fields`` for the count of suppressed repeats.
SUPPRESSED_FIELD = "suppressed"


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
    nothing was suppressed), as the record kind requires.
    """

    name = "fdr"

    def __init__(self, record: RecordSink) -> None:
        self._record = record

    def alert(self, level: AlertLevel, code: str, message: str, fields: Mapping[str, Any]) -> None:
        details = dict(fields)
        suppressed = details.pop(SUPPRESSED_FIELD, 0)
        self._record(
            ALERT_RECORD_KIND,
            {
                "level": level,
                "code": code,
                "message": message,
                "fields": details,
                "suppressed": suppressed if isinstance(suppressed, int) else 0,
            },
        )

    def close(self) -> None:
        """Nothing to release: the service owns the recorder."""
