"""The rate of ``build.start`` per verified peer (``builds.start_burst``,
``builds.start_refill_s``): a token bucket per principal (``Peer.key``: a uid, a
CURVE key), so one client cannot start builds back to back while another keeps
its share.  A token is taken only by a build that starts; the daemon's own
background rebuilds have their own back-off and are not counted here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float


class StartRateLimiter:
    def __init__(
        self, burst: int, refill_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst = burst
        self.refill_s = refill_s
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()
        #: ``build.start`` refused by the limit.
        self.refused = 0

    def retry_after(self, key: str) -> float | None:
        """None when ``key`` may start a build now, else the seconds until it may."""
        with self._lock:
            bucket = self._refilled(key)
            if bucket.tokens >= 1.0:
                return None
            self.refused += 1
            return (1.0 - bucket.tokens) * self.refill_s

    def take(self, key: str) -> None:
        """Count a build ``key`` started (after ``retry_after`` said it may)."""
        with self._lock:
            bucket = self._refilled(key)
            bucket.tokens = max(0.0, bucket.tokens - 1.0)

    def give_back(self, key: str) -> None:
        """A start ``take`` counted did not happen (its process could not be started)."""
        with self._lock:
            bucket = self._refilled(key)
            bucket.tokens = min(float(self.burst), bucket.tokens + 1.0)

    def _refilled(self, key: str) -> _Bucket:
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            self._forget_full(now)
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        bucket.tokens = min(
            float(self.burst), bucket.tokens + (now - bucket.updated) / self.refill_s
        )
        bucket.updated = now
        return bucket

    def _forget_full(self, now: float) -> None:
        """Buckets that have refilled hold nothing worth keeping: drop them, so the
        table holds only peers that started a build within ``burst * refill_s``."""
        for key, bucket in list(self._buckets.items()):
            if bucket.tokens + (now - bucket.updated) / self.refill_s >= self.burst:
                del self._buckets[key]
