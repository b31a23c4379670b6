"""Reply bytes between the engine worker and the bus thread: the bound on what
results hold after they are computed and before the bus has sent or dropped
them.

The worker hands each reply to the bus over an ``inproc://`` pipe whose
``SNDHWM`` counts messages, not bytes.  When the bus thread falls behind (two
busy cores, a flood of large results for a client that never reads), results
would pile up in that pipe, where no reply budget sees them: the daemon's
memory then grows with the backlog, not with ``bus.max_reply_bytes_*``.  So
the worker reserves a reply's bytes here before handing it over and waits
while the bus has more than ``limit_bytes`` untaken; the bus gives them back
once it has sent the reply (the reply budget counts it from then on) or
dropped it.  A reply always fits into an empty hand-off, so one result larger
than the limit still goes through; waiting makes the worker, and with it the
model's queue, feel the back-pressure instead of memory.
"""

from __future__ import annotations

import threading

#: Untaken reply bytes the worker may have handed to the bus: a few large
#: results, enough to keep the bus busy while the worker computes the next.
HANDOFF_BYTES = 16 * 1024 * 1024


class ReplyHandoff:
    """``reserve`` on the worker before each hand-over, ``taken`` on the bus after
    each reply it sent or dropped, ``close`` when the bus stops taking."""

    def __init__(self, limit_bytes: int = HANDOFF_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._held = 0
        self._closed = False
        self._waiting = 0
        self._changed = threading.Condition(threading.Lock())
        #: How many times the worker found the hand-off full and waited.
        self.waits = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def reserve(self, nbytes: int, timeout: float) -> bool:
        """Room for a reply of ``nbytes``; False when none came within ``timeout``
        (the worker then shows it is alive and asks again)."""
        with self._changed:
            if not self._fits(nbytes):
                self.waits += 1
                self._waiting += 1
                try:
                    if not self._changed.wait_for(lambda: self._fits(nbytes), timeout):
                        return False
                finally:
                    self._waiting -= 1
            self._held += nbytes
            return True

    def taken(self, nbytes: int) -> None:
        """The bus has sent or dropped a reply of ``nbytes`` that was handed over."""
        with self._changed:
            self._held = max(0, self._held - nbytes)
            if self._waiting:
                self._changed.notify_all()

    def close(self) -> None:
        """The bus takes no more: a waiting worker goes on (its replies are lost
        with the bus, which has stopped)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _fits(self, nbytes: int) -> bool:
        return self._closed or self._held == 0 or self._held + nbytes <= self.limit_bytes
