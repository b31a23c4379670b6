"""Hand build events from a thread that must never block to one that may.

TensorRT calls ``IProgressMonitor`` on its build thread; whatever the callback
does, the build waits for.  Writing to a terminal, a file or a pipe can block
(a paused terminal, a full pipe, a slow disk), so every consumer of build
events sits behind an ``EventRelay``: the callback only appends to a queue,
and the relay's own thread delivers in order.

Two kinds of item:

``offer``
    droppable detail (``step`` events): when ``capacity`` items are waiting it
    is dropped and counted in ``dropped``, never waited for;
``put``
    what must arrive (phase boundaries, cancel, the outcome, records, the
    report): queued even past ``capacity``.  Such items are few per build (a
    bounded number of phases), so the queue stays bounded.

``close`` delivers everything queued, then joins the thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class EventRelay(Generic[T]):
    def __init__(self, deliver: Callable[[T], None], *, capacity: int, name: str) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._deliver = deliver
        self._capacity = capacity
        self._items: deque[T] = deque()
        self._ready = threading.Condition()
        self._closing = False
        self.dropped = 0
        #: Deliveries that raised: counted, the relay goes on with the next item.
        self.delivery_errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def offer(self, item: T) -> bool:
        """Queue ``item`` unless ``capacity`` items wait already; never blocks."""
        with self._ready:
            if self._closing or len(self._items) >= self._capacity:
                self.dropped += 1
                return False
            self._items.append(item)
            self._ready.notify()
            return True

    def put(self, item: T) -> None:
        """Queue ``item`` whatever the backlog; never blocks."""
        with self._ready:
            if self._closing:
                raise RuntimeError("the relay is closed")
            self._items.append(item)
            self._ready.notify()

    def close(self, timeout: float | None = None) -> bool:
        """Deliver what is queued, stop the thread; False if it did not finish in
        ``timeout`` seconds (a consumer still blocked: it is a daemon thread)."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._items and not self._closing:
                    self._ready.wait()
                if not self._items:
                    return
                item = self._items.popleft()
            try:
                self._deliver(item)
            except Exception:
                self.delivery_errors += 1
