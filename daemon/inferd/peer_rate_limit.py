"""The rate of one operator op per verified peer: a token bucket per principal
(``Peer.key``: a uid, a CURVE key, an anonymous tcp peer's address, an IPv6
one's /64), so one client cannot repeat an op that costs the daemon work
(``build.start`` starts a build, ``runtime.switch`` prepares a runtime) back to
back while another keeps its share.  ``burst`` at once, then one
more every ``refill_s``; the refusal is ``RESOURCE_EXHAUSTED`` saying when to
retry.  The caller takes a token only once the op's arguments and preconditions
passed, so a request refused for them costs the peer nothing; the daemon's own
requests (``Peer.internal``) are not counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from inferd.types import Peer
from inferd_wire.protocol import Code, ProtocolError


@dataclass
class _Bucket:
    tokens: float
    updated: float


class PeerRateLimiter:
    def __init__(
        self,
        op: str,
        burst: int,
        refill_s: float,
        keys: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``op``: the op as the refusal names it; ``keys``: the config keys that set
        ``burst`` and ``refill_s``, named in the refusal."""
        self.op = op
        self.burst = burst
        self.refill_s = refill_s
        self.keys = keys
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()
        #: Requests refused by the limit.
        self.refused = 0

    def retry_after(self, key: str) -> float | None:
        """None when ``key`` may run the op now, else the seconds until it may (a
        refusal, counted)."""
        with self._lock:
            bucket = self._refilled(key)
            if bucket.tokens >= 1.0:
                return None
            self.refused += 1
            return (1.0 - bucket.tokens) * self.refill_s

    def take(self, key: str) -> None:
        """Count an op ``key`` ran (after ``retry_after`` said it may)."""
        with self._lock:
            bucket = self._refilled(key)
            bucket.tokens = max(0.0, bucket.tokens - 1.0)

    def give_back(self, key: str) -> None:
        """An op ``take`` counted did not happen (its process or thread could not be
        started)."""
        with self._lock:
            bucket = self._refilled(key)
            bucket.tokens = min(float(self.burst), bucket.tokens + 1.0)

    def refusal(self, peer: Peer, wait_s: float) -> ProtocolError:
        """The reply to ``peer`` refused by the limit, ``wait_s`` from ``retry_after``."""
        return ProtocolError(
            Code.RESOURCE_EXHAUSTED,
            f"{self.op} rate limit for {peer.describe()}: {self.burst} at once, then "
            f"one every {self.refill_s:g} s ({self.keys}); retry after {wait_s:.1f} s",
        )

    def describe(self) -> dict[str, float | int]:
        return {"burst": self.burst, "refill_s": self.refill_s, "refused": self.refused}

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
        table holds only peers that ran the op within ``burst * refill_s``."""
        for key, bucket in list(self._buckets.items()):
            if bucket.tokens + (now - bucket.updated) / self.refill_s >= self.burst:
                del self._buckets[key]
