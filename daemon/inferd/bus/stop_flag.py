"""The bus thread's stop (``BusServer.stop``), and how long it still reads after it.

A stopped bus thread still reads what arrives for ``READS_AFTER_STOP_NS``: a
request that was waiting when the stop came is answered (the router refuses it
``UNAVAILABLE``) rather than left to its client's timeout.  Past that, it reads
nothing more and ends once it has sent what is owed (the replies of the stop's
own steps: the requests it failed, the switches it gave up).  It used to read on
until a pass found nothing to read, which never came while a client kept
sending: one DEALER pipelining requests held the thread for the stop's whole
``bus.join`` bound (10 s), and the stop then went on without it
(``threads_did_not_stop``: its sockets open, the context not terminated).
"""

from __future__ import annotations

import threading
import time

#: How long after ``stop`` the bus thread still reads requests (its sockets and
#: the shm connections): a backlog waiting at the stop is refused in that time
#: (thousands of requests), and a client that never stops sending delays the
#: stop by no more.
READS_AFTER_STOP_NS = 100_000_000


class StopFlag:
    """Set once by ``BusServer.stop`` (any thread); read by the bus thread."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._at_ns = 0

    def set(self) -> None:
        self._at_ns = time.monotonic_ns()  # before the flag: read only once it is set
        self._set.set()

    def reads(self, now_ns: int) -> tuple[bool, bool]:
        """Whether the stop was asked for, and whether requests are still read at
        ``now_ns`` (monotonic): always before the stop, for a while after it."""
        if not self._set.is_set():
            return False, True
        return True, now_ns - self._at_ns < READS_AFTER_STOP_NS
