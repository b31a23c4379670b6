"""Giving freed heap memory back to the kernel after a bulk release.

glibc keeps memory a process freed for its next allocations: after a peer that
never read left and its queued replies (or an oversized message) were freed,
the daemon's RSS stays at its high-water mark (measured in DESIGN.md 56) until
``malloc_trim`` returns the free pages.  ``HeapTrimmer`` runs it on the bus
thread shortly after such a release, at most once per interval; elsewhere
(not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("inferd.bus")

#: Wait this long after a release before trimming: pyzmq's garbage-collector
#: thread frees the memory of zero-copy frames just after ZeroMQ let go of them.
_DELAY_NS = 200_000_000
#: At most one trim per interval (a trim walks every arena).
_INTERVAL_NS = 1_000_000_000
#: A release at least this large at once is worth a trim.
BULK_RELEASE_BYTES = 8 * 1024 * 1024
#: What ZeroMQ holds per received frame beyond its bytes (a ``zmq_msg_t``).
FRAME_OVERHEAD_BYTES = 64


def glibc_malloc_trim() -> Callable[[int], int] | None:
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


class HeapTrimmer:
    """Call ``request`` after freeing a lot at once and ``run_due`` every loop pass."""

    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim if trim is not None else glibc_malloc_trim()
        self._due_ns: int | None = None
        self._last_ns: int | None = None
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def request(self, now_ns: int) -> None:
        if self._trim is None or self._due_ns is not None:
            return
        due = now_ns + _DELAY_NS
        if self._last_ns is not None:
            due = max(due, self._last_ns + _INTERVAL_NS)
        self._due_ns = due

    def run_due(self, now_ns: int) -> None:
        if self._due_ns is None or now_ns < self._due_ns or self._trim is None:
            return
        started = time.monotonic_ns()
        released = self._trim(0)  # ctypes releases the GIL for the call
        took_us = (time.monotonic_ns() - started) // 1000
        self._due_ns = None
        self._last_ns = now_ns
        self.trims += 1
        log.debug("heap_trimmed", released=bool(released), took_us=took_us)
