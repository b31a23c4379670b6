"""Rate-limited FDR summaries of deadline misses.

Recording every ``DEADLINE_EXCEEDED`` would let an overloaded model flood the
recorder; instead, once per window, each model with misses gets one
``deadline_miss`` record with the count.  The counts come from the slots'
own statistics, so there is one source of truth for what was answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from inferd.serving.slot import ModelSlot
from inferd.types import RecordSink

DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


class DeadlineMissReporter:
    def __init__(
        self,
        slots: Mapping[str, ModelSlot],
        record: RecordSink,
        *,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._slots = slots
        self._record = record
        self._window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._reported = {name: 0 for name in slots}

    def tick(self) -> None:
        """Call periodically; writes the summaries of a window once it has elapsed."""
        if self._clock() - self._window_start >= self._window_s:
            self.flush()

    def flush(self) -> None:
        now = self._clock()
        window_s = max(now - self._window_start, 1e-9)
        for name, slot in self._slots.items():
            total = slot.stats.count(DEADLINE_EXCEEDED)
            missed = total - self._reported[name]
            if missed > 0:
                self._record(
                    "deadline_miss",
                    {"model": name, "count": missed, "window_s": round(window_s, 3)},
                )
            self._reported[name] = total
        self._window_start = now
