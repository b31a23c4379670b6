"""The recorder's write outages: the ``fdr_write_outage`` alert, once per outage.

An outage begins at a failure to write or sync (``FlightRecorder._fail``), or at
records dropped for a full queue (a disk slower than they come, said by the
writer's thread), and is over once a record assigned after it is durable.  The log says every
failure (``fdr_write_failed``, ERROR) and ``status`` counts the records dropped,
both on board only; the alert tells the ground, through the daemon's dispatcher:
its PUB and MAVLink hooks.  The ``fdr`` hook cannot deliver it: the writer backs
off after the failure, so the alert's record is dropped (counted, and reported by
the next ``fdr_dropped``) and the hook fails it (``record_alert``).  That loss
raises no second alert: it is the same outage, and nothing here writes a record."""

from __future__ import annotations

from pathlib import Path

from inferd.types import Alert, AlertSink

#: The alert's code; each failure's log line is ``fdr_write_failed``.
WRITE_OUTAGE_CODE = "fdr_write_outage"


class Outage:
    """Runs on the writer's thread (``alert`` is set before it starts)."""

    def __init__(self, directory: Path) -> None:
        self.alert: AlertSink | None = None
        self._directory = directory
        #: The first seq assigned after the failure that began the outage, while one lasts.
        self._since_seq: int | None = None

    def failed(self, error: str, next_seq: int) -> None:
        """A write or sync failed (``error``); ``next_seq`` is the next seq to assign."""
        if self._since_seq is not None:
            return
        self._since_seq = next_seq
        if self.alert is not None:
            message = (
                f"the flight data recorder cannot write ({error}): records are dropped and "
                "counted (status fdr.records_dropped) until a write succeeds"
            )
            self.alert(
                Alert("ERROR", WRITE_OUTAGE_CODE, message, {"directory": str(self._directory)})
            )

    def durable(self, durable_seq: int) -> None:
        """Every record up to ``durable_seq`` is durable, and nothing failed since."""
        if self._since_seq is not None and durable_seq >= self._since_seq:
            self._since_seq = None
