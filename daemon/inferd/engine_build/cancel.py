"""One shared cancellation state for a build.

Every stop source (``sigint``, ``sigterm``, ``control`` = the ``build.cancel``
op, ``ide``, ``timeout``, ``asyncio``, ``stall`` when configured) calls
``CancellationToken.cancel(source)``; the first request wins and is the
recorded cause.  ``step_complete`` returns False once it is set.  The token
also measures request -> acknowledgement (the builder returned) and
acknowledgement -> cleanup done, and holds the no-cancel zone around the final
write: a cancel arriving inside it is recorded as deferred, and a forced exit
(a second Ctrl-C) is carried out when it exits (``after_zone``).

``cancel`` runs in signal handlers, on the main thread, which may itself be
inside a section holding the token's lock (the zone's entry) or, through the
listeners, the progress adapter's or the event queue's: those locks are
reentrant, so a handler never waits for the very frame it interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

CANCEL_SOURCES = ("sigint", "sigterm", "control", "ide", "timeout", "asyncio", "stall")

T = TypeVar("T")


@dataclass(frozen=True)
class CancelRequest:
    source: str
    reason: str
    mono_ns: int
    wall_ns: int
    thread: str
    in_no_cancel_zone: bool


class CancellationToken:
    def __init__(self) -> None:
        self._event = threading.Event()
        #: Reentrant: a signal handler's ``cancel`` may interrupt its own thread here.
        self._lock = threading.RLock()
        self.request: CancelRequest | None = None
        self.ignored: list[CancelRequest] = []
        self.acknowledged_ns: int | None = None
        self.cleanup_done_ns: int | None = None
        self.zone: str | None = None
        self.zone_log: list[dict[str, Any]] = []
        #: What ``after_zone`` put off until the zone exits (a forced exit).
        self._after_zone: list[Callable[[], None]] = []
        self._listeners: list[Callable[[CancelRequest], None]] = []

    # -- requesting -------------------------------------------------------------------
    def cancel(self, source: str, reason: str = "") -> bool:
        """Request cancellation; True when this call set the token (first wins).
        Never blocks on the builder; safe from signal handlers and any thread."""
        if source not in CANCEL_SOURCES:
            raise ValueError(f"unknown cancel source {source!r}; one of {CANCEL_SOURCES}")
        with self._lock:
            request = CancelRequest(
                source=source,
                reason=reason or f"cancel requested by {source}",
                mono_ns=time.monotonic_ns(),
                wall_ns=time.time_ns(),
                thread=threading.current_thread().name,
                in_no_cancel_zone=self.zone is not None,
            )
            if self.request is not None:
                self.ignored.append(request)
                return False
            self.request = request
            listeners = list(self._listeners)
            self._event.set()
        for listener in listeners:
            with contextlib.suppress(Exception):
                listener(request)
        return True

    def add_listener(self, listener: Callable[[CancelRequest], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    # -- observing --------------------------------------------------------------------
    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def source(self) -> str | None:
        return None if self.request is None else self.request.source

    def state(self) -> str:
        if self.request is None:
            return "none"
        if self.cleanup_done_ns is not None:
            return "cleaned_up"
        if self.acknowledged_ns is not None:
            return "acknowledged"
        return "requested"

    # -- measuring --------------------------------------------------------------------
    def acknowledge(self) -> None:
        """The builder returned (after a cancel request)."""
        if self.request is not None and self.acknowledged_ns is None:
            self.acknowledged_ns = time.monotonic_ns()

    def cleanup_done(self) -> None:
        if self.request is not None and self.cleanup_done_ns is None:
            self.acknowledge()
            self.cleanup_done_ns = time.monotonic_ns()

    @property
    def cancel_latency_ms(self) -> float | None:
        if self.request is None or self.acknowledged_ns is None:
            return None
        return round(max(0, self.acknowledged_ns - self.request.mono_ns) / 1e6, 3)

    @property
    def cleanup_latency_ms(self) -> float | None:
        if self.acknowledged_ns is None or self.cleanup_done_ns is None:
            return None
        return round((self.cleanup_done_ns - self.acknowledged_ns) / 1e6, 3)

    # -- no-cancel zone -----------------------------------------------------------------
    @contextlib.contextmanager
    def no_cancel_zone(self, what: str) -> Iterator[bool]:
        """Around the final commit: a cancel arriving inside is deferred (the commit
        completes; the request is recorded with ``in_no_cancel_zone``).  Yields False,
        and enters no zone, when a cancel came first: checked under the same lock as
        the entry, so every cancel either stops the commit or is recorded deferred."""
        with self._lock:
            before = self.request
            if before is None:
                self.zone = what
        if before is not None:
            yield False
            return
        entered = time.monotonic_ns()
        try:
            yield True
        finally:
            with self._lock:
                self.zone = None
                arrived = self.request
                deferred, self._after_zone = self._after_zone, []
            self.zone_log.append(
                {
                    "zone": what,
                    "enteredNs": entered,
                    "exitedNs": time.monotonic_ns(),
                    "deferredCancel": None if arrived is None else arrived.source,
                }
            )
            for call in deferred:  # a forced exit: raises, as it would have
                call()

    def after_zone(self, call: Callable[[], None]) -> bool:
        """Put ``call`` off until the no-cancel zone exits (True); False when no zone
        is active (the caller calls it now).  For a forced exit (``cancel_on_signals``):
        one between the commit's two renames lost the committed engine (review G, F4).
        The deferred call runs on the thread that exits the zone: ``run_build``'s
        caller, which for ``cancel_on_signals`` is the main thread."""
        with self._lock:
            if self.zone is None:
                return False
            self._after_zone.append(call)
            return True


@contextlib.contextmanager
def cancel_on_signals(
    token: CancellationToken, *, force: Callable[[], None] | None = None
) -> Iterator[None]:
    """SIGINT -> ``sigint`` and SIGTERM -> ``sigterm`` on ``token`` while inside
    (main thread only).  A second SIGINT calls ``force`` (default: KeyboardInterrupt);
    inside the no-cancel zone, once the zone exits (``after_zone``): the commit's
    renames complete first, so the engine committed is never half replaced."""

    def forced() -> None:
        if force is not None:
            force()
        else:
            raise KeyboardInterrupt

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        source = "sigint" if signum == signal.SIGINT else "sigterm"
        # A second SIGINT forces; inside the zone, once it exits.
        if not token.cancel(source) and signum == signal.SIGINT and not token.after_zone(forced):
            forced()

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, on_signal),
        signal.SIGTERM: signal.signal(signal.SIGTERM, on_signal),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


async def run_build_async(
    build: Callable[[CancellationToken], T], token: CancellationToken | None = None
) -> T:
    """Run a blocking ``build(token)`` in a worker thread.  If the awaiting task
    is cancelled, the token is set with source ``asyncio``, the build is awaited
    to its (cooperative) end, and ``CancelledError`` propagates."""
    token = token or CancellationToken()
    future: Awaitable[T] = asyncio.ensure_future(asyncio.to_thread(build, token))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        token.cancel("asyncio", "the awaiting asyncio task was cancelled")
        with contextlib.suppress(Exception):
            await future
        raise
