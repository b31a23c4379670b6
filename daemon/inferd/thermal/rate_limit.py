"""The thermal monitor's log rate limit: a warning that would repeat at every
poll (lost telemetry, a failing sink, a poll that crashes) is logged at most
once per interval, with a count of what it held back."""

from __future__ import annotations


class RateLimit:
    """Allows one event per ``interval_ns`` and counts what it held back."""

    def __init__(self, interval_ns: int) -> None:
        self._interval_ns = interval_ns
        self._last_ns: int | None = None
        self.suppressed = 0

    def allow(self, now_ns: int) -> bool:
        if self._last_ns is not None and now_ns - self._last_ns < self._interval_ns:
            self.suppressed += 1
            return False
        self._last_ns = now_ns
        return True

    def take_suppressed(self) -> int:
        count, self.suppressed = self.suppressed, 0
        return count
