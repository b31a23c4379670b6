"""Source reads and opens on a helper thread, so a hung sensor or a hung open
cannot hang the monitor.

An I2C sensor or a jtop socket that stops answering blocks ``read`` for as
long as it likes; ``jtop.start()`` against a service that stopped answering,
or ``nvmlInit`` on a wedged driver, blocks an open the same way; and a thread
cannot be interrupted.  The monitor therefore waits for each call only until
a deadline; past it the poll counts as lost telemetry (which, while
throttled, is a recorded transition) and the poller keeps its pace.  The late
call is left to finish on its own thread and no new one starts until it has:
however long the sensor hangs, at most one helper thread exists per
``BoundedCall``.

What a late call returns belongs to exactly one party: the caller, which may
take it (``take_late``: a late open is used), or the ``discard`` callback:
at the next ``call`` if nobody took it (a late read is old, and dropped), or
once the caller has moved on (``abandon``), on the helper thread as the call
ends (a late open closes what it opened: no NVML or jtop handle leaks, even
when the monitor stopped waiting for it).  ``abandon`` also wakes a caller
waiting within the deadline: the monitor's stop waits for no call.  What a
running call uses (the source a read holds) can be given to its thread to
close as the call ends (``hand_over``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from inferd.errors import TelemetryUnavailableError

READ_THREAD_NAME = "inferd-thermal-read"
OPEN_THREAD_NAME = "inferd-thermal-open"

T = TypeVar("T")


class DeadlinePassedError(TelemetryUnavailableError):
    """The call did not return within the deadline, an earlier one still runs,
    or the caller has moved on (``abandon``)."""


def _keep(_outcome: object) -> None:
    return None


class _Call(Generic[T]):
    """One call on its own thread; its fields change under its owner's lock."""

    def __init__(self, owner: BoundedCall[T], fn: Callable[[], T], what: str) -> None:
        self.started_at = time.monotonic()
        self.finished = False
        #: Stays this if ``fn`` ends by a BaseException the thread cannot report.
        self.outcome: T | Exception = TelemetryUnavailableError(f"{what} ended without a result")
        #: Someone owns the outcome: the waiting caller, ``take_late`` or ``discard``.
        self.claimed = False
        #: Set last on the thread: nothing of this call (``discard`` included) runs any more.
        self.exited = False
        #: Run on this thread as the call ends (``hand_over``): what the call used is closed.
        self.then: Callable[[], None] | None = None
        #: Started by ``start``: nobody waits for it, so it hangs only past the deadline.
        self.detached = False
        self.thread = threading.Thread(
            target=self._run, args=(owner, fn), name=owner.thread_name, daemon=True
        )

    def _run(self, owner: BoundedCall[T], fn: Callable[[], T]) -> None:
        outcome = self.outcome
        try:
            outcome = fn()
        except Exception as exc:
            outcome = exc
        finally:
            try:
                owner._finished(self, outcome)
            finally:
                self.exited = True


class BoundedCall(Generic[T]):
    """``call(fn, name)`` returns what ``fn`` returned or raises what it raised,
    or ``DeadlinePassedError`` when it took longer than ``deadline_s``, an
    earlier call has still not returned, or the caller has moved on.  Called
    from one thread (the monitor's), except ``abandon``, ``hand_over``,
    ``wait_returned``, ``join_returned`` and ``abandoned_running`` (``stop``)."""

    def __init__(
        self,
        deadline_s: float,
        *,
        what: str,
        thread_name: str,
        discard: Callable[[T], None] = _keep,
    ) -> None:
        self.deadline_s = deadline_s
        self.thread_name = thread_name
        self._what = what
        self._discard = discard
        #: Guards every ``_Call``'s fields, ``_late`` and ``_abandoned``.
        self._lock = threading.Condition()
        self._late: _Call[T] | None = None
        #: The latest call, late or not: ``join`` waits for its thread to end.
        self._last: _Call[T] | None = None
        self._abandoned = False

    def _finished(self, attempt: _Call[T], outcome: T | Exception) -> None:
        with self._lock:
            attempt.outcome = outcome
            attempt.finished = True
            orphan = self._abandoned and not attempt.claimed
            if orphan:
                attempt.claimed = True
            then, attempt.then = attempt.then, None
            self._lock.notify_all()
        try:
            if orphan:  # nobody will take it: on this thread, as the call ends
                self._give_to_discard(outcome)
        finally:
            if then is not None:
                then()

    def _give_to_discard(self, outcome: T | Exception | None) -> None:
        if outcome is not None and not isinstance(outcome, Exception):
            self._discard(outcome)

    def hung_for_s(self) -> float | None:
        """How long the call that missed its deadline has run; None if none runs
        (a ``start``ed call still within the deadline has missed nothing)."""
        with self._lock:
            late = self._late
            if late is None or late.finished:
                return None
            running_s = time.monotonic() - late.started_at
            return None if late.detached and running_s < self.deadline_s else running_s

    def running(self) -> bool:
        """A call nobody waits for (one past its deadline, or ``start``ed) has not returned."""
        with self._lock:
            return self._late is not None and not self._late.finished

    def _take_late_locked(self) -> T | Exception | None:
        late = self._late
        if late is None or not late.finished:
            return None
        self._late = None
        if late.claimed:
            return None
        late.claimed = True
        return late.outcome

    def take_late(self) -> T | Exception | None:
        """What the call that missed its deadline returned (or raised), once it
        has finished: once, and never after ``abandon``."""
        with self._lock:
            return self._take_late_locked()

    def call(self, fn: Callable[[], T], name: str) -> T:
        """``fn()`` on a helper thread; ``name`` (the source) prefixes the errors."""
        with self._lock:
            if self._abandoned:
                raise DeadlinePassedError(f"{name}: no {self._what} starts: the caller stopped")
            late = self._late
            if late is not None and not late.finished:
                raise DeadlinePassedError(
                    f"{name}: an earlier {self._what} has not returned for "
                    f"{time.monotonic() - late.started_at:.1f} s"
                )
            attempt = _Call(self, fn, f"{name}: the {self._what}")
            # First: a thread that cannot start (the process's limit) changes nothing
            # here; as the latest call, the stop would hand it the source to close.
            attempt.thread.start()
            dropped = self._take_late_locked()  # a late result nobody took
            self._last = attempt
            # ``abandon`` wakes this wait: the stop need not wait out the deadline.
            self._lock.wait_for(lambda: attempt.finished or self._abandoned, self.deadline_s)
            finished = attempt.finished
            # Claimed already: abandoned meanwhile, and given to discard.
            claimed = finished and not attempt.claimed
            if claimed:
                attempt.claimed = True
            elif not finished:  # no second call starts while it runs, abandoned or not
                self._late = attempt
            stopped = self._abandoned
        self._give_to_discard(dropped)
        if not finished and stopped:
            raise DeadlinePassedError(f"{name}: the caller stopped waiting for the {self._what}")
        if not finished:
            raise DeadlinePassedError(
                f"{name}: the {self._what} did not finish within {self.deadline_s:g} s (it hangs)"
            )
        if not claimed:
            raise DeadlinePassedError(f"{name}: the {self._what} ended after the caller stopped")
        if isinstance(attempt.outcome, Exception):
            raise attempt.outcome
        return attempt.outcome

    def start(self, fn: Callable[[], T], name: str) -> bool:
        """``fn()`` on a helper thread that the caller does not wait for: a late
        call from the start.  Its outcome is ``take_late``'s once it has
        finished, no call starts while it runs, and ``hung_for_s`` counts it
        once it runs past the deadline.  False, and nothing started, once
        abandoned or while a late call's outcome is not taken (it may still
        run): never dropped here, as ``call`` drops one, since it may be wanted."""
        with self._lock:
            if self._abandoned or self._late is not None:
                return False
            attempt = _Call(self, fn, f"{name}: the {self._what}")
            attempt.detached = True
            try:
                attempt.thread.start()  # it reports under this lock: after the next line
            except RuntimeError:  # no thread to be had (the process's limit)
                return False
            self._late = self._last = attempt
            return True

    def abandon(self) -> None:
        """The caller moves on: what a call returns from now on goes to
        ``discard`` (a finished late result now, a running call's on its thread
        when it ends), a caller waiting for a call within its deadline stops
        waiting at once, and no call starts until ``resume``."""
        with self._lock:
            self._abandoned = True
            outcome = self._take_late_locked()
            self._lock.notify_all()
        self._give_to_discard(outcome)

    def hand_over(self, then: Callable[[], None]) -> bool:
        """Run ``then`` on the latest call's thread as the call ends, if it has
        not returned (``then`` closes what the call still uses); False if it
        has, or none ran: the caller runs ``then`` itself.  One of the two, so
        ``then`` runs once."""
        with self._lock:
            last = self._last
            if last is None or last.finished:
                return False
            last.then = then
            return True

    def resume(self) -> None:
        """Calls start again (the monitor restarts)."""
        with self._lock:
            self._abandoned = False

    def wait_returned(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the latest call to return; True if it has
        (or none ran)."""
        with self._lock:
            last = self._last
            return last is None or self._lock.wait_for(lambda: last.finished, max(timeout, 0.0))

    def join_returned(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the latest call's thread to end if the
        call has returned (its thread may still be exiting, or running
        ``discard`` or what was handed over to it); none for a call that has
        not returned: it cannot be interrupted, and once abandoned it does all
        that on its own thread when it returns.  False while its thread runs."""
        with self._lock:
            last = self._last
            returned = last is None or last.finished
        if last is None:
            return True
        if returned:
            last.thread.join(max(timeout, 0.0))
        return last.exited or not last.thread.is_alive()

    def abandoned_running(self) -> bool:
        """The caller moved on (``abandon``) while the latest call, or the
        ``discard`` of what it returned, still runs on its thread."""
        with self._lock:
            last = self._last if self._abandoned else None
        return last is not None and not last.exited and last.thread.is_alive()
