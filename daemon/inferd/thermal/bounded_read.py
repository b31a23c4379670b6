"""Source reads on a helper thread, so a hung sensor cannot hang the monitor.

An I2C sensor or a jtop socket that stops answering blocks ``read`` for as
long as it likes, and a thread cannot be interrupted.  The monitor therefore
waits for each read only until a deadline; past it the poll counts as lost
telemetry (which, while throttled, is a recorded transition) and the poller
keeps its pace.  The late read is left to finish on its own thread and no new
one starts until it has: however long the sensor hangs, at most one helper
thread exists.
"""

from __future__ import annotations

import threading
import time

from inferd.errors import TelemetryUnavailableError
from inferd.thermal.reading import ThermalReading, ThermalSource

READ_THREAD_NAME = "inferd-thermal-read"


class _Read:
    def __init__(self, source: ThermalSource) -> None:
        self.started_at = time.monotonic()
        self.finished = False
        #: Stays this if ``read`` ends by a BaseException the thread cannot report.
        self.outcome: ThermalReading | Exception = TelemetryUnavailableError(
            f"{source.name}: the read ended without a reading"
        )
        self.thread = threading.Thread(
            target=self._run, args=(source,), name=READ_THREAD_NAME, daemon=True
        )
        self.done = threading.Condition()

    def _run(self, source: ThermalSource) -> None:
        try:
            self.outcome = source.read()
        except Exception as exc:
            self.outcome = exc
        finally:
            with self.done:
                self.finished = True
                self.done.notify_all()


class BoundedReader:
    """``read(source)`` returns the source's reading or raises what it raised,
    or ``TelemetryUnavailableError`` when it took longer than ``deadline_s``
    or an earlier read has still not returned.  Called from one thread."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._late: _Read | None = None

    def hung_for_s(self) -> float | None:
        """How long the read that missed its deadline has run; None if none runs."""
        late = self._late
        if late is None or late.finished:
            return None
        return time.monotonic() - late.started_at

    def read(self, source: ThermalSource) -> ThermalReading:
        hung_for = self.hung_for_s()
        if hung_for is not None:
            raise TelemetryUnavailableError(
                f"{source.name}: an earlier read has not returned for {hung_for:.1f} s"
            )
        attempt = _Read(source)
        attempt.thread.start()
        with attempt.done:
            finished = attempt.done.wait_for(lambda: attempt.finished, self.deadline_s)
        if not finished:
            self._late = attempt
            raise TelemetryUnavailableError(
                f"{source.name}: no reading within {self.deadline_s:g} s (the read hangs)"
            )
        self._late = None
        if isinstance(attempt.outcome, Exception):
            raise attempt.outcome
        return attempt.outcome

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a late read to return; False if it still runs."""
        late = self._late
        if late is None:
            return True
        late.thread.join(max(timeout, 0.0))
        return not late.thread.is_alive()
