"""Closing what a client handed the daemon, off the threads that serve requests.

``close(2)`` can block for as long as a descriptor's owner decides: a TCP socket
with ``SO_LINGER`` and unsent data waits out its linger time, a file on a FUSE
mount waits for the mount's server to answer its flush, and closing a Unix
socket closes the descriptors still queued in it, each as slowly.  The last
reference to such a file is dropped on return from whatever system call dropped
it, in the thread that made the call.  So every descriptor that came with
``SCM_RIGHTS`` and every client's ``shm.sock`` connection is closed here, on the
``inferd-shm-closer`` thread, never on the engine worker, the bus thread or the
registration thread (DESIGN.md 120).

What waits here is bounded: past ``MAX_WAITING`` (a close that does not end,
and clients that keep sending descriptors), the connection that brought more is
closed, a message bringing more than one memfd is not read at all (its
connection is closed: ``shm.messages``) and new connections are refused
(``RESOURCE_EXHAUSTED``); past twice as many, the registration thread accepts
none until fewer wait.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import structlog

log = structlog.get_logger("inferd.shm")

#: Descriptors (and connection sockets) that may wait to be closed before the
#: connections bringing more are closed: far below the daemon's ``LimitNOFILE``.
MAX_WAITING = 64


class DescriptorCloser(threading.Thread):
    """A thread that closes the descriptors and sockets handed to it, in order."""

    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        super().__init__(name="inferd-shm-closer", daemon=True)
        self.max_waiting = max_waiting
        self._changed = threading.Condition()
        self._waiting: deque[int | socket.socket] = deque()
        self._stopping = False
        #: When the close in progress began (``time.monotonic_ns``); None: none is.
        self._closing_since_ns: int | None = None
        self.closed = 0

    def close_later(self, items: Iterable[int | socket.socket]) -> None:
        """Hand descriptors or sockets over to be closed (any thread; never blocks)."""
        with self._changed:
            self._waiting.extend(items)
            self._changed.notify()

    @property
    def backed_up(self) -> bool:
        """Whether more than ``max_waiting`` wait to be closed."""
        with self._changed:
            return len(self._waiting) > self.max_waiting

    @property
    def saturated(self) -> bool:
        """Whether more than twice ``max_waiting`` wait: past refusing connections
        (each refused one waits here too), not even accepting them."""
        with self._changed:
            return len(self._waiting) > 2 * self.max_waiting

    def run(self) -> None:
        while True:
            with self._changed:
                while not self._waiting and not self._stopping:
                    self._changed.wait()
                if not self._waiting:
                    return
                item = self._waiting.popleft()
                self._closing_since_ns = time.monotonic_ns()
            try:
                if isinstance(item, socket.socket):
                    item.close()
                else:
                    os.close(item)
            except OSError as exc:  # EIO from a file's last flush: it is closed all the same
                log.warning("shm_close_failed", error=exc.strerror)
            with self._changed:
                self._closing_since_ns = None
                self.closed += 1

    def stop(self, timeout: float) -> None:
        """Close what waits, then end; give up after ``timeout`` s on a close that
        does not end (the thread is a daemon thread: the process can still exit)."""
        with self._changed:
            self._stopping = True
            self._changed.notify()
        if self.is_alive():
            self.join(timeout)
        if self.is_alive():
            log.warning("shm_close_still_blocked", waiting=len(self._waiting))

    def status(self) -> dict[str, Any]:
        with self._changed:
            since = self._closing_since_ns
            return {
                "waiting": len(self._waiting),
                "closed": self.closed,
                "blocked_s": (
                    0.0 if since is None else round((time.monotonic_ns() - since) / 1e9, 3)
                ),
            }
