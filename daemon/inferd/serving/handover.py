"""A prepared engine handed over to the engine worker, and the threads preparing them.

A runtime switch (``serving/switching.py``) and a failover while serving
(``serving/failover.py``) prepare an engine on their own thread and queue its swap
for the engine worker.  ``Handover`` makes that swap happen once or never: the
worker takes it, or its preparer gives it up (it waited too long, or the daemon
stops), whichever comes first and never both, so a swap reported as not made never
happens later; the one that gave it up releases the prepared engine.

``Preparers`` holds those threads so that ``stop`` can give their swaps up and wait
for them: a thread still inside a runtime's native code (loading an engine) when
the interpreter exits can crash it (SIGSEGV, SIGABRT).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

Outcome = Literal["settled", "not_taken", "given_up", "stuck"]


class Handover:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: ``preparing``, then ``queued``, then ``taken`` or ``given_up``.
        self.state = "preparing"
        #: Set once the worker has run the swap, or the swap was given up.
        self.settled = threading.Event()

    def queue(self) -> bool:
        """About to queue the swap: False once given up (shutting down)."""
        return self._advance("preparing", "queued")

    def take(self) -> bool:
        """On the worker: True when it is to swap now (then ``settled.set()`` after)."""
        return self._advance("queued", "taken")

    def _advance(self, state: str, to: str) -> bool:
        with self._lock:
            if self.state != state:
                return False
            self.state = to
            return True

    def give_up(self) -> bool:
        """True unless the worker has taken the swap (it now never will)."""
        with self._lock:
            if self.state == "taken":
                return False
            self.state = "given_up"
        self.settled.set()
        return True

    def wait(self, timeout_s: float) -> Outcome:
        """After queuing (or failing to): ``settled`` once the worker ran the swap;
        ``not_taken`` when it did not take it within ``timeout_s`` (given up here);
        ``given_up`` when given up before (``stop``, a closed scheduler); ``stuck``
        when taken but still running after another ``timeout_s``."""
        if not self.settled.wait(timeout_s) and self.give_up():
            return "not_taken"
        if self.state == "given_up":
            return "given_up"
        return "settled" if self.settled.wait(timeout_s) else "stuck"


H = TypeVar("H", bound=Handover)


class Preparers(Generic[H]):
    """The threads preparing an engine, each with its handover."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, H] = {}
        self.stopping = False

    def start(self, thread: threading.Thread, handover: H) -> bool:
        """Start ``thread``; False (not started) once ``stop`` has begun."""
        with self._lock:
            if self.stopping:
                return False
            # Started under the lock: ``stop`` never sees a thread it cannot join.
            self._running[thread] = handover
            try:
                thread.start()
            except BaseException:  # e.g. at the process's thread limit: not ours then
                del self._running[thread]
                raise
            return True

    def enter(self, handover: H) -> bool:
        """The calling thread prepares ``handover``; False once ``stop`` has begun."""
        with self._lock:
            if self.stopping:
                return False
            self._running[threading.current_thread()] = handover
            return True

    def leave(self) -> None:
        """The calling thread is done (called at its end, registered or not)."""
        with self._lock:
            self._running.pop(threading.current_thread(), None)

    def stop(self, wait_s: float, given_up: Callable[[H], None]) -> bool:
        """Give up every swap the worker has not taken (``given_up`` is called for
        each, at once), then wait for the threads, up to ``wait_s`` in all; True
        when they all ended.  Call once the worker takes no more calls."""
        with self._lock:
            self.stopping = True
            running = dict(self._running)
        deadline = time.monotonic() + wait_s
        for handover in running.values():
            if handover.give_up():
                given_up(handover)
        for thread in running:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in running)
