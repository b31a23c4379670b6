"""Per-model request counters, latency percentiles and a latency histogram
(thread-safe).

The one record of what a model answered: the ``status`` op reports
``snapshot()`` and the metrics exposition reads the same object
(``snapshot()`` and ``latency_histogram()``), so the two never disagree.
"""

from __future__ import annotations

import contextlib
import threading
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

_WINDOW = 4096

#: Upper bounds (inclusive, microseconds) of the latency histogram's buckets, from
#: half a millisecond (a small model on a GPU) to ten seconds (a large model on
#: the CPU fallback); one more bucket (+Inf) holds the rest.
LATENCY_BUCKETS_US: tuple[int, ...] = (
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
)


@dataclass(frozen=True)
class LatencyHistogram:
    """Receipt-to-result latency of every OK reply since start.

    ``cumulative[i]`` counts the replies at most ``bounds_us[i]``; its last
    entry (one more than ``bounds_us``) counts them all (``+Inf``)."""

    bounds_us: tuple[int, ...]
    cumulative: tuple[int, ...]
    sum_us: int

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class ModelStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received = 0
        self._responses: Counter[str] = Counter()
        self._latencies_us: deque[int] = deque(maxlen=_WINDOW)
        self._late_results = 0
        self._buckets = [0] * (len(LATENCY_BUCKETS_US) + 1)
        self._latency_sum_us = 0

    def received(self) -> None:
        with self._lock:
            self._received += 1

    def answered(self, code: str, latency_us: int | None = None, *, late: bool = False) -> None:
        """Record one reply; ``code`` is ``OK`` or an error code."""
        with self._lock:
            self._responses[code] += 1
            if latency_us is not None:
                self._latencies_us.append(latency_us)
                self._buckets[bisect_left(LATENCY_BUCKETS_US, latency_us)] += 1
                self._latency_sum_us += latency_us
            if late:
                self._late_results += 1

    def retract(self, code: str, latency_us: int | None = None, *, late: bool = False) -> None:
        """Take back one ``answered`` with these arguments: a reply counted but never
        sent, whose request is answered, and counted, as what it gets instead."""
        with self._lock:
            self._responses[code] -= 1
            if self._responses[code] <= 0:
                del self._responses[code]
            if latency_us is not None:
                with contextlib.suppress(ValueError):  # no longer in the window
                    self._latencies_us.remove(latency_us)
                self._buckets[bisect_left(LATENCY_BUCKETS_US, latency_us)] -= 1
                self._latency_sum_us -= latency_us
            if late:
                self._late_results -= 1

    def count(self, code: str) -> int:
        """Replies answered with ``code`` so far."""
        with self._lock:
            return self._responses[code]

    def latency_histogram(self) -> LatencyHistogram:
        with self._lock:
            buckets, total_us = list(self._buckets), self._latency_sum_us
        cumulative: list[int] = []
        running = 0
        for count in buckets:
            running += count
            cumulative.append(running)
        return LatencyHistogram(LATENCY_BUCKETS_US, tuple(cumulative), total_us)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            latencies = np.fromiter(self._latencies_us, dtype=np.int64)
            responses = dict(self._responses)
            received, late = self._received, self._late_results
        percentiles: dict[str, Any] = {"window": int(latencies.size)}
        if latencies.size:
            p50, p99 = np.percentile(latencies, [50, 99])
            percentiles.update(p50=int(p50), p99=int(p99))
        return {
            "requests": received,
            "responses": responses,
            "errors": sum(count for code, count in responses.items() if code != "OK"),
            "late_results": late,
            "latency_us": percentiles,
        }
