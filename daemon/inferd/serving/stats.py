"""Per-model request counters and latency percentiles (thread-safe)."""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any

import numpy as np

_WINDOW = 4096


class ModelStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received = 0
        self._responses: Counter[str] = Counter()
        self._latencies_us: deque[int] = deque(maxlen=_WINDOW)
        self._late_results = 0

    def received(self) -> None:
        with self._lock:
            self._received += 1

    def answered(self, code: str, latency_us: int | None = None, *, late: bool = False) -> None:
        """Record one reply; ``code`` is ``OK`` or an error code."""
        with self._lock:
            self._responses[code] += 1
            if latency_us is not None:
                self._latencies_us.append(latency_us)
            if late:
                self._late_results += 1

    def count(self, code: str) -> int:
        """Replies answered with ``code`` so far."""
        with self._lock:
            return self._responses[code]

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
