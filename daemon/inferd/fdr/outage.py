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

import threading
from pathlib import Path

from inferd.types import Alert, AlertSink

#: The alert's code; each failure's log line is ``fdr_write_failed``.
WRITE_OUTAGE_CODE = "fdr_write_outage"


class Outage:
    """``failed`` and ``durable`` run on the writer's thread, ``say`` on any (``alert`` is
    set before the writer starts)."""

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
        self.say(error)

    def say(self, error: str) -> None:
        """The ``fdr_write_outage`` alert for ``error`` (any thread)."""
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


#: Set on a thread while it raises an overflow's alert: a record the alert's own ``fdr``
#: hook then finds the queue full for says nothing more (no alert inside an alert).
_SAYING = threading.local()


class Overflow:
    """Records a full queue refused (a disk slower than they come, or stuck): said at
    once, from the producer's thread (a stuck disk never finishes the writer's batch),
    one ``fdr_write_outage`` an episode; an episode ends at a batch of the writer's
    during which no record overflowed, so a flood is one episode, not one a batch."""

    def __init__(self, outage: Outage) -> None:
        self._outage = outage
        self._lock = threading.Lock()
        self._said = False  # this episode's alert was raised
        self._since_batch = 0  # overflows since the writer's last batch

    def dropped(self, reason: str) -> str:
        """A record found the queue full (``reason``), on any thread: the words for
        ``last_error``; the episode's first overflow raises its alert."""
        error = f"{reason}: the disk is slower than the records come"
        nested = getattr(_SAYING, "on", False)
        with self._lock:
            self._since_batch += 1
            if self._said or nested:
                return error
            self._said = True
        _SAYING.on = True
        try:
            self._outage.say(error)
        finally:
            _SAYING.on = False
        return error

    def batch_done(self) -> None:
        """The writer finished a batch (its thread): an episode with no overflow since
        its last batch is over."""
        with self._lock:
            if not self._since_batch:
                self._said = False
            self._since_batch = 0
